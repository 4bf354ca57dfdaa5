"""Compile oomb's Triton kernels for an H100/H200 (sm_90) without a GPU, as a CUDA launch would build
them (bf16 tiles, no interpreter upcast, the launcher's specialization of the arguments): errors of dtype or
shape that the CPU interpreter hides (it upcasts every tile to float32) fail here, and the shared memory and
registers reported are those of the kernel the GPU runs.

    python tests/compile_for_hopper.py capture OUT.json   # under TRITON_INTERPRET=1: a tiny bf16 model's
                                                          # dense and sparse steps on the triton backend,
                                                          # every autotuned kernel launch's argument types
                                                          # and their specialization
    python tests/compile_for_hopper.py compile [OUT.json] # without the interpreter: each captured launch
                                                          # at the 7B shape, and the score kernels' variants
    python tests/compile_for_hopper.py compile OUT.json --all-configs   # every config of each list

``compile`` prints one JSON line per variant: {"kernel", "variant", "config", "ok", "error" or "shared",
"registers", "spill_bytes", "instructions"} (the last three where the wheel ships cuobjdump).

The specialization matters: Triton's launcher marks 16-byte aligned pointers and integers divisible by 16,
and turns integers equal to 1 into constants (unless the kernel lists them in ``do_not_specialize``). Without
those marks the compiler cannot prove the K/V rows contiguous and aligned, loads them through registers
instead of asynchronous copies (``cp.async``), and allocates no pipeline stages: the shared memory of such a
compile is far below the real kernel's (the forward's 128 x 128 tiles: 98,304 bytes unmarked, 229,376
marked, against the H200's 232,448).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

from oomb.config import PerformanceConfig, SparseConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(GROUP=7, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=128, UPCAST=False)
"""The 7B shape's constants (Qwen2.5-7B: 28 query heads over 4 KV heads, head dim 128, pages of 128)."""
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "int32": "i32", "int64": "i64", "bool": "i1",
          "uint8": "u8", "int8": "i8"}


def _argument_type(value) -> str | None:
    """Triton's signature type of a runtime argument (None: pass it as a constant)."""
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + DTYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return "i64" if abs(value) >= 2 ** 31 else "i32"
    if isinstance(value, float):
        return "fp32"
    return None


def _specialization(value) -> object:
    """What Triton's launcher makes of a runtime argument when it may specialize it: "D" (a 16-byte aligned
    tensor, an integer divisible by 16), 1 (an integer equal to 1: a constant), or "" (nothing)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    kind, mark = native_specialize_impl(CUDABackend, value, False, True, True)
    return 1 if kind == "constexpr" else mark


def capture(out: str) -> None:
    """Run tiny bf16 steps under the interpreter and record every autotuned launch's argument types and
    their specialization (the kernel's do_not_specialize lists are applied when compiling)."""
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from helpers import build_tiny_model, random_ids
    from triton.runtime.autotuner import Autotuner

    import oomb

    launches: dict[str, dict] = {}
    run = Autotuner.run

    def recording_run(self, *args, **kwargs):
        fn = self.fn.fn  # the Python function under the interpreter's wrapper
        names = list(fn.__code__.co_varnames[:fn.__code__.co_argcount])
        given = {**dict(zip(names, args, strict=False)), **{k: v for k, v in kwargs.items() if k in names}}
        types = {name: _argument_type(value) for name, value in given.items() if _argument_type(value)}
        specialized = {name: _specialization(given[name]) for name in types}
        constants = {k: v for k, v in kwargs.items()
                     if k in names and (_argument_type(v) is None or isinstance(v, (bool, str)))}
        key = f"{fn.__module__}.{fn.__name__} {sorted(constants.items(), key=str)}"
        launches.setdefault(key, {"module": fn.__module__, "kernel": fn.__name__, "types": types,
                                  "specialization": specialized,
                                  "constants": {k: v for k, v in constants.items() if k not in SHAPE}})
        return run(self, *args, **kwargs)

    Autotuner.run = recording_run
    model = build_tiny_model("qwen2", seed=1).to(torch.bfloat16)
    ids = random_ids(1, 256, seed=1)
    for config in (oomb.OOMBConfig(chunk_size=128, page_size=32, performance=PerformanceConfig(backend="triton")),
                   oomb.OOMBConfig(chunk_size=128, page_size=32, attention="sparse", sparse=SparseConfig(budget=1),
                                   performance=PerformanceConfig(backend="triton"))):
        oomb.forward_backward(model, ids, None, config)
    Path(out).write_text(json.dumps(list(launches.values()), default=str))


def _compile(kernel, types: dict, constants: dict, config_index: int = 0, specialization: dict | None = None) -> dict:
    """Compile one launch for sm_90 as the launcher would (``specialization``: capture's marks; None: every
    pointer 16-byte aligned, no integer marked) and report its resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    fn, config = kernel.fn, kernel.configs[config_index]
    values = {**constants, **config.kwargs}
    if specialization is None:
        specialization = {name: "D" for name, kind in types.items() if kind and kind.startswith("*")}
    signature, fixed, attrs = {}, {}, {}
    for index, param in enumerate(fn.params):
        if param.is_constexpr or param.name in values:
            value = values.get(param.name, param.default)
            if value is inspect.Parameter.empty:
                raise ValueError(f"no value for constexpr {param.name}")
            signature[param.name], fixed[(index,)] = "constexpr", value
            continue
        mark = "" if param.do_not_specialize else specialization.get(param.name, "")
        if mark == 1:  # an integer equal to 1 becomes a constant, as at launch
            signature[param.name], fixed[(index,)] = "constexpr", 1
            continue
        signature[param.name] = types.get(param.name) or "i32"
        if mark == "D" and not param.do_not_specialize_on_alignment:
            attrs[(index,)] = CUDABackend.parse_attr("D")
    compiled = triton.compile(ASTSource(fn, signature, fixed, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    return {"config": [*config.kwargs.values(), config.num_warps, config.num_stages],
            "shared": compiled.metadata.shared, **_resources(compiled.asm["cubin"])}


SASS_COUNTED = ("HGMMA", "MUFU.EX2", "FFMA", "FMUL", "FADD", "LDGSTS", "STL", "LDL")
"""Instructions counted in a kernel's machine code (every occurrence in the binary, not per iteration): tensor-core
products, exponentials, the float32 multiply-adds, multiplies and adds of the softmax, asynchronous copies,
spill stores and loads."""


def _resources(cubin: bytes) -> dict:
    """Registers per thread, spill stack bytes and SASS_COUNTED's instruction counts of a compiled kernel
    (cuobjdump; {} without it)."""
    import re
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run([str(tool), "-res-usage", file.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "-sass", file.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", report)
    if not found:
        return {}
    counts = {name: len(re.findall(rf"\b{re.escape(name)}\b", sass)) for name in SASS_COUNTED}
    return {"registers": int(found[1]), "spill_bytes": int(found[2]), "instructions": counts}


INNERMOST_STRIDES = {"stride_qd", "stride_kd", "stride_ad", "stride_bd", "stride_ll"}
"""The score kernels' strides along a contiguous last dimension (head dim; lse's queries): 1 at the 7B shape."""


def _marks_at_7b(kernel) -> dict:
    """The launcher's marks for a kernel that the CPU cannot capture, at the 7B shape: every pointer 16-byte
    aligned, every stride a multiple of 16 but the innermost ones (1), nothing else marked."""
    return {p.name: 1 if p.name in INNERMOST_STRIDES else "D" for p in kernel.fn.params
            if p.name.endswith("_ptr") or p.name.startswith("stride_")}


def _score_variants():
    """The score kernels (they run on CUDA only: nothing to capture on the CPU), at the 7B shape:
    (name, variant, kernel, argument types, constants, specialization marks, config index)."""
    from oomb.attention import triton_block_scores, triton_scores

    exact = _marks_at_7b(triton_scores._exact_scores_kernel)
    summary = _marks_at_7b(triton_block_scores._block_scores_kernel)
    lse = _marks_at_7b(triton_block_scores._row_lse_kernel)

    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "table_ptr": "*i32",
                "list_ptr": "*i32", "out_ptr": "*fp32", "scratch_ptr": "*fp32", "scale": "fp32"}
    for listed, leak_free in ((False, False), (True, False), (True, True)):
        rows = (128 + 1 if leak_free else 128) * 7
        yield ("exact_scores", f"listed={listed} leak_free={leak_free}", triton_scores._exact_scores_kernel,
               pointers, dict(SHAPE, DOT_PRECISION="tf32", ROW_STRIDE=1, LISTED=listed, LEAK_FREE=leak_free,
                              NO_PREVIOUS=False, ROWS=rows), exact, 0)
    # rerank's listed kernel: every config autotuning may pick at pages of 128 (the first is above)
    for index, config in enumerate(triton_scores._exact_scores_kernel.configs[1:], start=1):
        if SHAPE["PAGE_SIZE"] % config.kwargs["BLOCK_N"] == 0 and config.kwargs["BLOCK_N"] > 16:
            yield ("exact_scores", f"listed=True config={config.kwargs}", triton_scores._exact_scores_kernel,
                   pointers, dict(SHAPE, DOT_PRECISION="tf32", ROW_STRIDE=1, LISTED=True, LEAK_FREE=False,
                                  NO_PREVIOUS=False, ROWS=128 * 7), exact, index)
    normalised = dict(pointers, lse_ptr="*fp32")
    for minmax in (True, False):
        yield ("block_scores", f"minmax={minmax}", triton_block_scores._block_scores_kernel, pointers,
               dict(SHAPE, DOT_PRECISION="tf32", MINMAX=minmax), summary, 0)
        # sparse_candidate_pooling="softmax_max": the rows' log-sum-exps, then the normalised block scores
        yield ("row_lse", f"minmax={minmax}", triton_block_scores._row_lse_kernel, normalised,
               dict(SHAPE, DOT_PRECISION="tf32", MINMAX=minmax), lse, 0)
        yield ("block_scores", f"minmax={minmax} normalised", triton_block_scores._block_scores_kernel, normalised,
               dict(SHAPE, DOT_PRECISION="tf32", MINMAX=minmax, NORMALISED=True), summary, 0)


def _plain_variants():
    """The kernels without autotuning (CUDA only, one launch config each): the sparse backward's row add and
    the fused loss's gradient kernel, at the 7B shape's widths (pointers marked aligned: marks None)."""
    import triton

    from oomb.attention import triton_loss_gradient as loss_gradient_kernel
    from oomb.attention import triton_row_add

    class Pinned:  # what _compile reads of an autotuner: the function and its (one) launch config
        def __init__(self, fn, num_warps: int) -> None:
            self.fn, self.configs = fn, [triton.Config({}, num_warps=num_warps, num_stages=1)]

    rows = Pinned(triton_row_add._add_rows_kernel, 4)
    for pool in ("fp32", "bf16"):
        yield ("row_add", f"pool={pool}", rows, {"pool_ptr": f"*{pool}", "grad_ptr": "*bf16", "sorted_rows_ptr": "*i64",
                                                 "order_ptr": "*i64"}, {"BLOCK": triton_row_add._BLOCK}, None, 0)
    loss = Pinned(loss_gradient_kernel._logits_to_gradient_kernel, 8)
    for write in (True, False):
        yield ("loss_gradient", f"write={write}", loss, {"logits_ptr": "*bf16", "targets_ptr": "*i64",
                                                         "scale_ptr": "*fp32", "loss_ptr": "*fp32"},
               {"IGNORE": -100, "WRITE": write, "BLOCK": loss_gradient_kernel._BLOCK}, None, 0)


def compile_all(captured: str | None, all_configs: bool = False) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    import importlib

    # (name, variant, kernel, types, constants, specialization marks, config index)
    variants = [*_score_variants(), *_plain_variants()]
    for launch in json.loads(Path(captured).read_text()) if captured else []:
        kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
        name = f"{launch['module'].rsplit('.', 1)[-1]}.{launch['kernel']}"
        capped = [{}] + ([{"SOFTCAP": 30.0}] if any(p.name == "SOFTCAP" for p in kernel.fn.params) else [])
        # the tiny model's steps launch the dense kernels over key windows only: the whole-history variant too
        capped += [{"WINDOW": False}] if launch["constants"].get("WINDOW") else []
        for constants in ({**launch["constants"], **cap} for cap in capped):  # (gemma2's logit softcapping)
            for index in range(len(kernel.configs) if all_configs else 1):
                variants.append((name, json.dumps(constants, sort_keys=True), kernel, launch["types"],
                                 dict(SHAPE, **constants), launch.get("specialization"), index))
    for name, variant, kernel, types, constants, specialization, config_index in variants:
        try:
            result = {"ok": True, **_compile(kernel, types, constants, config_index, specialization)}
        except Exception as err:  # reported; the caller fails
            result = {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[-1][:300]}"}
        print(json.dumps({"kernel": name, "variant": variant, **result}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "capture":
        capture(sys.argv[2])
    else:
        compile_all(sys.argv[2] if len(sys.argv) > 2 and not sys.argv[2].startswith("--") else None,
                    all_configs="--all-configs" in sys.argv)
