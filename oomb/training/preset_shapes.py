"""The model shapes oomb can build with random weights (``--preset``): their Hugging Face model type and
config options, and where the numbers of the hybrid and MoE shapes come from. Plain data, so the training
config can validate a preset name without importing transformers."""

from __future__ import annotations

BYTE_VOCAB = 256
"""Byte values of oomb's built-in tokenizer (presets.byte_tokenizer), which adds <|endoftext|> after them."""

PRESETS: dict[str, tuple[str, dict]] = {
    # name: (model_type, config options). Real models' shapes, for random-weight runs and benchmarks.
    "tiny-qwen2": ("qwen2", dict(
        vocab_size=BYTE_VOCAB + 1, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen2.5-0.5b": ("qwen2", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6,
        max_position_embeddings=32768)),
    "qwen2.5-7b": ("qwen2", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, rope_theta=1e6,
        max_position_embeddings=32768)),
    "llama3-8b": ("llama", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, rope_theta=5e5,
        max_position_embeddings=131072)),
    # Hybrid-attention and mixture-of-experts shapes (docs/models.md, "Presets"). Options not given take
    # the transformers config class's defaults; PRESET_SOURCES says where each given number comes from.
    "gemma-3-12b": ("gemma3_text", dict(
        num_hidden_layers=48, hidden_size=3840, intermediate_size=15360, num_attention_heads=16,
        num_key_value_heads=8, sliding_window=1024,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
        max_position_embeddings=131072)),
    "gemma-2-9b": ("gemma2", dict(
        num_hidden_layers=42, hidden_size=3584, intermediate_size=14336, num_attention_heads=16,
        num_key_value_heads=8, max_position_embeddings=131072)),
    "gpt-oss-20b": ("gpt_oss", dict(num_hidden_layers=24, num_local_experts=32, max_position_embeddings=131072)),
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        num_hidden_layers=48, head_dim=128, norm_topk_prob=True, rope_theta=1e6, max_position_embeddings=40960)),
}
PRESET_SOURCES: dict[str, str] = {
    "gemma-3-12b": (
        "transformers.Gemma3TextConfig() defaults (a gemma-3 text model, fields not set here): vocab 262208, "
        "head_dim 256, tied embeddings, layer_types five sliding : one full (sliding_window_pattern 6), "
        "query_pre_attn_scalar 256, RoPE bases 10K local / 1M global, no softcapping. Set here (the defaults are "
        "a smaller model's): 48 layers, hidden 3840, intermediate 15360, 16 heads, 8 KV heads, window 1024 (the "
        "default is 4096), from google/gemma-3-12b-pt's config.json; the global layers' linear RoPE factor 8 from "
        "the same file (not checked here: nothing is downloaded; it does not change memory). 11.77 B parameters."),
    "gemma-2-9b": (
        "transformers.Gemma2Config() defaults (gemma-2-2b's shape otherwise): vocab 256000, head_dim 256, tied "
        "embeddings, 4096-token windows on alternate layers, query_pre_attn_scalar 256, attention logit softcap "
        "50 and final logit softcap 30, RoPE base 10K. Set here for the 9B model (google/gemma-2-9b's "
        "config.json): 42 layers, hidden 3584, intermediate 14336, 16 heads, 8 KV heads; 131072 positions so "
        "that long random-weight runs do not warn (the model was trained on 8192). 9.24 B parameters."),
    "gpt-oss-20b": (
        "transformers.GptOssConfig() defaults, which are gpt-oss-120b's shape: hidden 2880, expert intermediate "
        "2880, 64 heads, 8 KV heads, head_dim 64, top-4 routing, vocab 201088, 128-token windows on alternate "
        "layers, attention sinks and biases, YaRN RoPE (factor 32 over 4096). Set here for the 20B model: 24 "
        "layers and 32 experts (openai/gpt-oss-20b's config.json). 20.91 B parameters; 4.19 B active per token, "
        "3.61 B without the input embedding (the card's 3.6 B)."),
    "qwen3-30b-a3b": (
        "transformers.Qwen3MoeConfig() defaults: hidden 2048, 32 heads, 4 KV heads, 128 experts, 8 per token, "
        "moe_intermediate_size 768, vocab 151936, untied head, every layer MoE (the dense intermediate_size "
        "6144 is unused). Set here (from Qwen/Qwen3-30B-A3B's config.json): 48 layers (the default is 24), "
        "head_dim 128 (the class derives 2048 / 32 = 64 without it), norm_topk_prob, RoPE base 1e6, 40960 "
        "positions. 30.53 B parameters (3.35 B active)."),
}
"""Where each hybrid or MoE preset's numbers come from (the dense presets copy their model's config.json)."""
TINY_PRESET = "tiny-qwen2"
