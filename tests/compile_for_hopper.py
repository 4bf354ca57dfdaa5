"""Compile oomb's score kernels for an H100/H200 (sm_90) without a GPU, as a CUDA launch would build
them (bf16 tiles, no interpreter upcast): errors of dtype or shape that the CPU interpreter hides (it
upcasts every tile to float32) fail here. Run in a process without TRITON_INTERPRET; prints one JSON
line per kernel variant: {"kernel", "variant", "ok", "error", "shared"}."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from oomb.attention import triton_block_scores, triton_scores  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "table_ptr": "*i32",
            "list_ptr": "*i32", "out_ptr": "*fp32", "scratch_ptr": "*fp32"}


def compile_variant(kernel, config: triton.Config, constants: dict) -> dict:
    fn = kernel.fn
    constants = {**constants, **config.kwargs}
    signature = {name: POINTERS.get(name, "constexpr" if name in constants else "fp32" if name == "scale" else "i32")
                 for name in fn.arg_names}
    source = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=HOPPER,
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    return {"shared": compiled.metadata.shared}


def variants():
    """(kernel name, variant, kernel, constants): the 7B shape (D 128, 7 query heads per KV head, page 128)."""
    shape = dict(GROUP=7, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=128, UPCAST=False, DOT_PRECISION="tf32")
    for listed, leak_free in ((False, False), (True, False), (True, True)):
        rows = (128 + 1 if leak_free else 128) * 7
        yield ("exact_scores", f"listed={listed} leak_free={leak_free}", triton_scores._exact_scores_kernel,
               dict(shape, ROW_STRIDE=1, LISTED=listed, LEAK_FREE=leak_free, NO_PREVIOUS=False, ROWS=rows))
    for minmax in (True, False):
        yield ("block_scores", f"minmax={minmax}", triton_block_scores._block_scores_kernel,
               dict(shape, MINMAX=minmax))


def main() -> None:
    for name, variant, kernel, constants in variants():
        config = kernel.configs[0]
        try:
            result = {"ok": True, **compile_variant(kernel, config, constants)}
        except Exception as err:  # reported, the caller fails
            result = {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[-1][:300]}"}
        print(json.dumps({"kernel": name, "variant": variant, **result}), flush=True)


if __name__ == "__main__":
    main()
