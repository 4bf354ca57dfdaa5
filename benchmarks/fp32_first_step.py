"""First vs second step of a float32 model with head_dim 128 on CUDA, backend auto (float32 -> triton
with one tile config per kernel): the pruned config must compile and the first step must not tune
for minutes. Prints both times."""

import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from oomb.config import OOMBConfig
from oomb.engine import forward_backward

cfg = Qwen2Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128, vocab_size=1000, max_position_embeddings=16384)
model = Qwen2ForCausalLM(cfg).cuda().float().train()
ids = torch.randint(0, 1000, (1, 8192), device="cuda")
config = OOMBConfig(backend="triton", chunk_size=2048)
for step in range(2):
    start = time.perf_counter()
    loss = forward_backward(model, ids, config=config)
    torch.cuda.synchronize()
    print(f"step {step + 1}: {time.perf_counter() - start:.2f} s, loss {float(loss):.4f}", flush=True)
