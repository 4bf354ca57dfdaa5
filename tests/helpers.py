"""Builders shared by the tests: tiny random models per family and gradient comparisons."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 160
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    intermediate_size=128,
    max_position_embeddings=4096,
)
FAMILIES = {
    # name: (config class, model class, family-specific config options)
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v biases
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),  # q/k norms; head_dim != 64 / 4
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}
PARAM_NOISE = 0.02
"""Std of the noise added to every parameter so biases and norm weights are not 0 / 1."""


def build_tiny_model(family: str, seed: int = 0, **overrides) -> nn.Module:
    """A tiny fp32 model of ``family`` with random weights, every parameter perturbed."""
    config_cls, model_cls, options = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **options, **overrides}))
    perturb_(model, seed)
    return model


def lora_model(model: nn.Module, target_modules: list[str], dropout: float = 0.0, **options) -> nn.Module:
    """PEFT LoRA (r 4) on ``model`` with every B nonzero (PEFT starts B at zero, which would leave A's gradient
    zero and untested)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=target_modules, **options)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return peft_model


def perturb_(model: nn.Module, seed: int, std: float = PARAM_NOISE) -> None:
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * std)


def save_tiny_model(family: str, directory: Path, seed: int = 0, **overrides) -> Path:
    build_tiny_model(family, seed, **overrides).save_pretrained(directory)
    return directory


def load_model(family: str, directory: Path) -> nn.Module:
    _, model_cls, _ = FAMILIES[family]
    return model_cls.from_pretrained(directory, attn_implementation="sdpa", dtype=torch.float32)


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every trainable parameter's gradient (cloned), by name."""
    return {
        name: None if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def hf_step(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """Full-sequence Hugging Face forward + backward; returns the detached loss."""
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    return loss.detach()


def relative_error(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None]) -> float:
    """||got - want|| / ||want|| over all parameters together (a None gradient counts as zero)."""
    assert got.keys() == want.keys()
    num = den = 0.0
    for name, ref in want.items():
        ref = torch.zeros(()) if ref is None else ref.double()
        val = got[name]
        val = torch.zeros(()) if val is None else val.double()
        num += float(((val - ref) ** 2).sum())
        den += float((ref**2).sum())
    assert den > 0, "the reference gradient is zero: the comparison would be meaningless"
    return (num / den) ** 0.5


def random_ids(batch: int, tokens: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def page_locked(tensor: torch.Tensor) -> bool:
    """Whether the CUDA driver holds a CPU tensor's memory page-locked (registered or pinned);
    ``Tensor.is_pinned`` says False for memory registered with ``cudaHostRegister``."""
    from oomb.kv.mapped import pointer_attributes

    return pointer_attributes(tensor)[0] == 1  # cudaMemoryTypeHost; 0 is unregistered host memory


REQUIRE_REAL_MODEL_ENV = "OOMB_REQUIRE_REAL_MODEL"


def real_model_required() -> bool:
    """In CI (``$CI``) or with ``OOMB_REQUIRE_REAL_MODEL=1`` a missing real model fails the tests
    instead of skipping them, so CI cannot pass without ever running them."""
    ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
    return ci or os.environ.get(REQUIRE_REAL_MODEL_ENV, "").strip() == "1"


def real_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory, or a skip (a failure where it is required)
    carrying ``RealModelUnavailable``'s message, which says what to install."""
    import pytest

    from oomb import real_model

    try:
        return real_model.smollm2_dir()
    except real_model.RealModelUnavailable as err:
        if real_model_required():
            pytest.fail(f"the real model is required here (${REQUIRE_REAL_MODEL_ENV}=1 or $CI): {err}",
                        pytrace=False)
        pytest.skip(f"real model unavailable: {err}")


def visible_from_selections(selections: dict, layer: int, batch: int, kv_heads: int, tokens: int,
                            page_size: int) -> torch.Tensor:
    """(B, Hkv, T, T) bool: what a sparse step read in ``layer``, from the selections stage 1 kept
    ((layer, chunk index) -> (chunk, selection)): each chunk's own keys causally, and per query block
    its selected history pages (all history where the selection is None)."""
    visible = torch.zeros(batch, kv_heads, tokens, tokens, dtype=torch.bool)
    for (sel_layer, _), (chunk, selection) in selections.items():
        if sel_layer != layer:
            continue
        s, e = chunk.start, chunk.end
        visible[:, :, s:e, s:e] = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        if selection is None:
            visible[:, :, s:e, :s] = True
            continue
        for b in range(batch):
            for h in range(kv_heads):
                for j, pages in enumerate(selection[b, h].tolist()):
                    rows = slice(s + j * page_size, min(e, s + (j + 1) * page_size))
                    for page in pages:
                        visible[b, h, rows, page * page_size:(page + 1) * page_size] = True
    return visible


def free_port() -> int:
    """A TCP port free on this machine now, for a process group's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed_worker(rank: int, world: int, port: int, out_dir: str, names: list, run_one,
                           device_type: str = "cpu", stop_at_error: bool = True) -> None:
    """A spawned rank's life: join the group (gloo on the CPU, NCCL on GPUs), run ``run_one(name, device)``
    for each name, write ``rank{rank}.json`` of the results (a traceback where one raised; after it the
    ranks may no longer agree on the collectives that come next, so with ``stop_at_error`` the rest is
    skipped) and leave as ``end_distributed_worker`` does."""
    import json
    import traceback

    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks on a two-core machine
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    results = {}
    for name in names:
        try:
            results[name] = run_one(name, device)
        except BaseException:  # reported by the test, which then fails with the traceback
            results[name] = {"traceback": traceback.format_exc()}
            if stop_at_error:
                break
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    end_distributed_worker()


def end_distributed_worker(barrier: bool = False) -> None:
    """Tear the process group down and leave without interpreter finalization.

    Gloo's worker threads can still hold work objects that reference Python callables (DDP communication
    hooks, future callbacks); destroying them while the interpreter shuts down aborted a CI run twice
    ("terminate called without an active exception", SIGABRT). The results are on disk by now, so skipping
    the finalizers loses nothing. ``barrier`` waits for the other ranks first (only where they all get here).
    """
    import torch.distributed as dist

    if barrier:
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str):
    """A script of the repository (benchmarks/, examples/: not a package) imported as a module."""
    import importlib.util

    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem.replace("-", "_") + "_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_benchmark(name: str, argv: list[str], monkeypatch) -> None:
    """Run benchmarks/NAME.py's main() in this process with ``argv`` (its smoke runs)."""
    module = load_script(f"benchmarks/{name}.py")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    module.main()


def sparse_replace(options, **changes):
    """``dataclasses.replace`` of a SparseConfig, taking its research options (pooling, selection, ...) by name too."""
    import dataclasses

    from oomb.config import SparseResearch

    names = {f.name for f in dataclasses.fields(SparseResearch)}
    research = {k: changes.pop(k) for k in list(changes) if k in names}
    if research:
        changes["research"] = dataclasses.replace(changes.get("research", options.research), **research)
    return dataclasses.replace(options, **changes)
