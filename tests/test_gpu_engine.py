"""End to end on a GPU: oomb (triton and cudnn backends, bf16) vs an fp32 full-sequence reference.

oomb's gradient error must be no worse than Hugging Face's own bf16 SDPA backward against the same
fp32 reference, both pooled over several sequences. Each case's numbers are written to
$OUT/gpu_engine_*.json when OUT is set (device runs).
"""

import json
import math
import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import oomb
from oomb.config import PerformanceConfig

pytestmark = pytest.mark.gpu


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().float().clone() for p in model.parameters()]


def _error_by_kind(model, grads, reference) -> dict[str, float]:
    """Each kind of parameter's share of the squared relative error (1e-6 units): where an error
    above HF's comes from (attention kernels show in v_proj/o_proj, per-chunk rounding in norms)."""
    den = sum(float((r**2).sum()) for r in reference)
    shares: dict[str, float] = {}
    for (name, _), g, r in zip(model.named_parameters(), grads, reference, strict=True):
        kind = name.rsplit(".", 2)[-2] if name.endswith(("weight", "bias")) else name
        kind = kind + ".bias" if name.endswith("bias") else kind
        shares[kind] = shares.get(kind, 0.0) + float(((g - r) ** 2).sum()) / den * 1e6
    return {k: round(v, 3) for k, v in sorted(shares.items())}


def _rel_err(grads, reference) -> float:
    num = sum(float(((g - r) ** 2).sum()) for g, r in zip(grads, reference, strict=True))
    den = sum(float((r**2).sum()) for r in reference)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    path = tmp_path_factory.mktemp("gpu_qwen2")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return Qwen2ForCausalLM.from_pretrained(path, attn_implementation="sdpa").cuda().float()


# What "no worse than HF" means here. Both errors are pooled over the sequences in SEEDS, and oomb
# fails if its pooled error exceeds HF's by more than two standard errors of the paired per-sequence
# ratio (a one-sided test at about 97.5%). A point comparison on one sequence is a coin toss at
# parity: for one and the same configuration the per-sequence ratio spans 0.90x to 1.06x, and oomb's
# cudnn backend with one chunk (HF's very attention kernel on this machine) still measures 1.0006x
# pooled over 8 (H200, benchmarks/results/gpu_engine/). Earlier single-sequence runs that read as
# defects: 1.003x and 1.011x (triton, several chunks), 1.058x (triton, one chunk), 1.123x (cudnn,
# streamed blocks); pooled over 8 sequences those cases measure 0.987x-1.004x, 1.003x-1.006x and
# 1.006x. Linear layers' weight gradients are float32 throughout (oomb/fp32_linear.py).
@pytest.mark.parametrize("batch, tokens, chunk", [(1, 3000, 1024), (2, 1500, 512), (1, 3000, 4096)])
def test_triton_bf16_gradients_no_worse_than_hf_bf16(fp32_model, batch, tokens, chunk):
    _assert_no_worse_than_hf(_bf16_errors(fp32_model, batch, tokens, chunk, "triton"))


# cuDNN returns every window's dQ, dK, dV (and the chunk's dK, dV per query head, before the group
# sum) in bf16, so each (chunk, window) contribution is rounded once more than in HF's one backward;
# the triton kernels accumulate them in float32. Measured, it stays within the same bound.
@pytest.mark.parametrize("batch, tokens, chunk, options", [
    (1, 3000, 1024, {}), (2, 1500, 512, {}), (1, 3000, 4096, {}),
    # Blocks of 2 pages of 128: the GPU-resident history still runs as one window (whole_history).
    (1, 3000, 1024, {"offload.stream_block_pages": 2}),
    # Host offload with the default blocks (one history window here).
    (2, 1500, 512, {"offload.enabled": True}),
    # Streamed blocks must stay blocks (the history is not on the GPU), so cuDNN rounds each block's
    # dQ share to bf16: on the first sequence 1.114x HF's error, pooled over 8 sequences 1.006x.
    (1, 3000, 1024, {"offload.enabled": True, "offload.stream_block_pages": 2}),
    # The layers run compiled (OOMBConfig.performance.compile_layers' automatic choice on CUDA), with layer replay
    # (above) and without: fused kernels keep float32 between ops that eager rounds to bf16. Eager, with replay
    # and without:
    (1, 3000, 1024, {"performance.checkpoint_layers": False}),
    (1, 3000, 1024, {"performance.compile_layers": False}),
    (2, 1500, 512, {"performance.checkpoint_layers": False, "performance.compile_layers": False}),
    # Stage 2 taking stage 1's attention outputs, compiled layers (their stage-2 queries can differ from stage
    # 1's by rounding, and the backward pairs them with stage 1's output).
    pytest.param(1, 3000, 1024, {"performance.checkpoint_layers": False, "performance.keep_attention_outputs": True},
                 id="1-3000-1024-keep_attention_outputs"),
])
def test_cudnn_bf16_gradients_no_worse_than_hf_bf16(fp32_model, batch, tokens, chunk, options):
    _assert_no_worse_than_hf(_bf16_errors(fp32_model, batch, tokens, chunk, "cudnn", options))


# Sequences each case is measured on. One sequence is too few: the error of a bf16 step moves by
# several percent with any change in where it rounds. On one sequence, two sets of Triton tile
# configs whose attention errors agree to three digits gave
# 0.986x and 1.058x HF's error; HF's own error, pooled over 4 sequences, is 0.01121 to 0.01152
# depending on its attention implementation.
SEEDS = tuple(range(1, 9))


def _bf16_errors(fp32_model, batch: int, tokens: int, chunk: int, backend: str, options: dict | None = None) -> dict:
    """Relative errors of HF's bf16 SDPA backward and of oomb's bf16 step against an fp32 full-sequence
    backward, pooled over SEEDS' sequences; saved as $OUT/gpu_engine_*.json when OUT is set."""
    bf16_model = Qwen2ForCausalLM(fp32_model.config).cuda().bfloat16()
    bf16_model.load_state_dict(fp32_model.state_dict())
    bf16_model.set_attn_implementation("sdpa")
    options = options or {}  # dotted OOMBConfig paths
    config = oomb.OOMBConfig(chunk_size=chunk, page_size=128).with_options({"performance.backend": backend, **options})
    squared = {"hf": 0.0, "oomb": 0.0, "reference": 0.0}
    loss_gaps = {"hf": 0.0, "oomb": 0.0}
    by_kind, per_sequence = {"hf": {}, "oomb": {}}, []
    for seed in SEEDS:
        torch.manual_seed(seed)
        ids = torch.randint(0, fp32_model.config.vocab_size, (batch, tokens), device="cuda")
        fp32_model.zero_grad(set_to_none=True)
        ref_loss = fp32_model(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        reference = _grads(fp32_model)
        fp32_model.zero_grad(set_to_none=True)
        bf16_model.zero_grad(set_to_none=True)
        losses = {"hf": bf16_model(input_ids=ids, labels=ids).loss}
        losses["hf"].backward()
        grads = {"hf": _grads(bf16_model)}
        bf16_model.zero_grad(set_to_none=True)
        losses["oomb"] = oomb.forward_backward(bf16_model, ids, config=config)
        grads["oomb"] = _grads(bf16_model)
        row = {"seed": seed, "loss_fp32": float(ref_loss.detach())}
        squared["reference"] += sum(float((r**2).sum()) for r in reference)
        for who in ("hf", "oomb"):
            squared[who] += sum(float(((g - r) ** 2).sum()) for g, r in zip(grads[who], reference, strict=True))
            loss_gaps[who] += abs(float(losses[who].detach()) - float(ref_loss.detach()))
            row[f"{who}_rel_err"] = _rel_err(grads[who], reference)
            row[f"loss_{who}_bf16"] = float(losses[who].detach())
            for kind, share in _error_by_kind(bf16_model, grads[who], reference).items():
                by_kind[who][kind] = round(by_kind[who].get(kind, 0.0) + share / len(SEEDS), 3)
        per_sequence.append(row)
    hf_err, oomb_err = ((squared[who] / squared["reference"]) ** 0.5 for who in ("hf", "oomb"))
    result = {"batch": batch, "tokens": tokens, "chunk": chunk, "backend": backend, "options": options,
              "sequences": len(SEEDS), "hf_bf16_sdpa_rel_err": hf_err, "oomb_rel_err": oomb_err,
              "ratio": oomb_err / hf_err, "ratio_standard_error": _standard_error(per_sequence),
              "loss_gap_hf": loss_gaps["hf"] / len(SEEDS),
              "loss_gap_oomb": loss_gaps["oomb"] / len(SEEDS), "per_sequence": per_sequence,
              "squared_error_by_kind_e6": by_kind}
    suffix = "".join(f"_{part}" for part in ([] if backend == "triton" else [backend]) + sorted(options))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"gpu_engine_b{batch}_t{tokens}_c{chunk}{suffix}.json"), "w") as f:
            json.dump(result, f, indent=2)
    print(result)
    return result


def _standard_error(per_sequence: list[dict]) -> float:
    """Standard error of the mean log ratio oomb/HF over the sequences (paired: same inputs)."""
    logs = torch.tensor([math.log(r["oomb_rel_err"] / r["hf_rel_err"]) for r in per_sequence], dtype=torch.float64)
    return float(logs.std() / len(logs) ** 0.5)


def _assert_no_worse_than_hf(result: dict) -> None:
    bound = math.exp(2 * result["ratio_standard_error"])
    assert result["ratio"] <= bound, (result["ratio"], bound, result)
    assert result["loss_gap_oomb"] <= 2 * result["loss_gap_hf"] + 1e-3, result


def test_triton_matches_torch_backend_fp32(fp32_model):
    """Same step through both backends in fp32: only TF32 rounding in the kernels separates them."""
    torch.manual_seed(2)
    ids = torch.randint(0, fp32_model.config.vocab_size, (1, 2100), device="cuda")
    grads = {}
    for backend in ("torch", "triton"):
        fp32_model.zero_grad(set_to_none=True)
        oomb.forward_backward(fp32_model, ids, config=oomb.OOMBConfig(chunk_size=512, page_size=64,
                                                                      performance=PerformanceConfig(backend=backend)))
        grads[backend] = _grads(fp32_model)
    fp32_model.zero_grad(set_to_none=True)
    assert _rel_err(grads["triton"], grads["torch"]) <= 1e-2


@pytest.mark.parametrize("compile_layers", [False, True])
def test_dense_step_is_deterministic_on_gpu(fp32_model, compile_layers):
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(fp32_model.config).cuda().bfloat16()
    model.load_state_dict(fp32_model.state_dict())
    ids = torch.randint(0, model.config.vocab_size, (1, 2500), device="cuda")
    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        config = oomb.OOMBConfig(chunk_size=1024,
                                 performance=PerformanceConfig(backend="triton", checkpoint_layers=not compile_layers,
                                                               compile_layers=compile_layers))
        oomb.forward_backward(model, ids, config=config)
        runs.append(_grads(model))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
