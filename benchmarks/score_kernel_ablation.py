"""Where rerank's listed-page score kernel spends its time: the kernel with one part of its inner loop left
out or changed, timed against itself (no hardware counters needed; differences of times).

The kernel (oomb/attention/triton_scores.py ``_exact_scores_kernel`` with listed pages) runs per key tile a
matrix product (``Q K^T``), a row maximum, one exponential per logit and a row sum. At head dim 128 the
tensor cores and the exponential unit need about the same time per logit, so the kernel's speed depends on
how well the two overlap. Each variant is the kernel's source with one textual change, compiled as its own
module, pinned to one launch config (the autotuner's pick by default):

    base       the kernel as it is
    no_exp     the exponential left out (its argument summed): what the exponential unit costs
    no_max     the row maximum left out (a zero reference): what the reduction costs
    dot_sum    neither: the loads, the matrix product and a row sum
    ftz        the exponential as one ``ex2.approx.ftz.f32`` (flush-to-zero) instruction
    prefetch   the next tile's ``Q K^T`` issued before this tile's softmax (a hand-pipelined loop)
    prefetch_ftz  both

Variants other than base, ftz, prefetch and prefetch_ftz compute wrong scores on purpose; ftz and prefetch
must match base (printed as ``diff``). Workload: benchmarks/score_kernel_configs.py's (one 4096-query chunk of
the 7B shape, 256 listed pages per block). Also writes each variant's PTX instruction counts.

    python benchmarks/score_kernel_ablation.py --histories 131072 --out score_kernel_ablation.json
    python benchmarks/score_kernel_ablation.py --smoke   # CPU (Triton interpreter): base, no_exp, no_max
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_SOURCE = ROOT / "oomb" / "attention" / "triton_scores.py"

_EXP = "l_t = tl.sum(tl.exp2(s * qk_scale - m_pn[:, None]), 1)"
_MAX = "m_pn = tl.maximum(m_p, tl.max(s, 1) * qk_scale)"
_FTZ_HELPER = '''

@triton.jit
def _exp2_ftz(x):
    """2^x in one flush-to-zero instruction (denormal results become 0)."""
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)
'''
# The listed loop's head, hand-pipelined: tile t + 1's product is issued before tile t's softmax.
_LOOP_HEAD = """        for t in range(0, n_tiles):
            slot = t % TILES_PER_PAGE
            first_key = next_first
            k_rows = next_rows
            ahead = tl.minimum(t + 1, n_tiles - 1)
            next_first = (tl.load(list_row_ptr + ahead // TILES_PER_PAGE) * PAGE_SIZE
                          + (ahead % TILES_PER_PAGE) * BLOCK_N)
            next_rows = _key_offsets(table_row_ptr, next_first, offs_n, offs_n < BLOCK_N, stride_kp, stride_kt,
                                     PAGE_SIZE, BLOCK_N, False)
            k = _load_tile(k_base + k_rows[:, None] + offs_d[None, :] * stride_kd, offs_n < BLOCK_N, d_ok, False,
                           EVEN_D)
            if UPCAST:
                k = k.to(tl.float32)
            # unscaled logits: the maxima are taken before the scale, which then folds into each exponent's
            # subtraction (one fused multiply-add per logit instead of a multiply and a subtraction)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
"""
_PREFETCH_HEAD = """        k = _load_tile(k_base + next_rows[:, None] + offs_d[None, :] * stride_kd, offs_n < BLOCK_N,
                       d_ok, False, EVEN_D)
        if UPCAST:
            k = k.to(tl.float32)
        s_next = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        first_next = next_first
        for t in range(0, n_tiles):
            slot = t % TILES_PER_PAGE
            s = s_next
            first_key = first_next
            ahead = tl.minimum(t + 1, n_tiles - 1)
            first_next = (tl.load(list_row_ptr + ahead // TILES_PER_PAGE) * PAGE_SIZE
                          + (ahead % TILES_PER_PAGE) * BLOCK_N)
            k_rows = _key_offsets(table_row_ptr, first_next, offs_n, offs_n < BLOCK_N, stride_kp, stride_kt,
                                  PAGE_SIZE, BLOCK_N, False)
            k = _load_tile(k_base + k_rows[:, None] + offs_d[None, :] * stride_kd, offs_n < BLOCK_N, d_ok, False,
                           EVEN_D)
            if UPCAST:
                k = k.to(tl.float32)
            s_next = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
"""


def _edits(name: str) -> list[tuple[str, str]]:
    """The (old, new) text replacements of a variant; each old text must occur exactly once."""
    zero_max = (_MAX, "m_pn = tl.maximum(m_p, tl.zeros([BLOCK_M], dtype=tl.float32))")
    ftz = [(_EXP, _EXP.replace("tl.exp2(", "_exp2_ftz(")),
           ("\n\n@triton.jit\ndef _scaled_logits", _FTZ_HELPER + "\n\n@triton.jit\ndef _scaled_logits")]
    prefetch = [(_LOOP_HEAD, _PREFETCH_HEAD)]
    return {
        "base": [],
        "no_exp": [(_EXP, _EXP.replace("tl.exp2(", "("))],
        "no_max": [zero_max],
        "dot_sum": [(_EXP, "l_t = tl.sum(s, 1)"), zero_max],
        "ftz": ftz,
        "prefetch": prefetch,
        "prefetch_ftz": prefetch + ftz,
    }[name]


VARIANTS = ["base", "no_exp", "no_max", "dot_sum", "ftz", "prefetch", "prefetch_ftz"]
EXACT = {"base", "ftz", "prefetch", "prefetch_ftz"}


def load_variant(name: str, workdir: Path):
    """The kernel module with the variant's edits, imported from its own file (Triton compiles from source)."""
    source = KERNEL_SOURCE.read_text().replace("from .triton_paged import", "from oomb.attention.triton_paged import")
    for old, new in _edits(name):
        if source.count(old) != 1:
            raise SystemExit(f"variant {name}: the kernel's source no longer holds {old.splitlines()[0]!r} once")
        source = source.replace(old, new)
    path = workdir / f"score_variant_{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"score_variant_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def ptx_counts(kernel) -> dict[str, int]:
    """Instruction counts of the variant's compiled PTX (all compiled specialisations), by opcode family."""
    counts: collections.Counter = collections.Counter()
    for cache in getattr(kernel.fn, "device_caches", {}).values():
        for compiled in cache[0].values():
            for line in compiled.asm.get("ptx", "").splitlines():
                match = re.match(r"\s*(?:@%p\d+\s+)?([a-z][\w.]*)", line)
                if match and match.group(1).split(".")[0] in ("ex2", "max", "fma", "add", "mul", "wgmma", "mma",
                                                               "setp", "selp", "cp", "ld", "st", "shfl", "bar"):
                    counts[match.group(1)] += 1
    return dict(counts.most_common(40))


def parse_args() -> argparse.Namespace:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from score_kernel_configs import add_workload_arguments, smoke_workload

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(p, [131072], iters=9)
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--config", type=int, nargs=4, default=[128, 128, 4, 2],
                   metavar=("BLOCK_M", "BLOCK_N", "WARPS", "STAGES"))
    args = smoke_workload(p.parse_args())
    if args.smoke:  # on the CPU only the interpretable variants
        args.config = [16, 16, 1, 1]
    return args


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from attention import Timer, kernel_device, write_kernel_report
    from score_kernel_configs import _inputs

    device = kernel_device(args.smoke)
    import triton

    if device.type == "cpu":  # the interpreter runs no inline PTX
        args.variants = [v for v in args.variants if "ftz" not in v]
    m, n, warps, stages = args.config
    config = triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)
    timer = Timer(device)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        modules = {name: load_variant(name, Path(workdir)) for name in args.variants}
        for history in args.histories:
            inputs = _inputs(args, history, device)
            reference = None
            for name, module in modules.items():
                kernel = module._exact_scores_kernel
                kernel.configs = [config]
                call = functools.partial(module.exact_page_scores, **inputs)
                row = {"history": history, "variant": name, "config": str(config)}
                try:
                    out = call()
                    if name == "base":
                        reference = out
                    if reference is not None and name in EXACT:
                        row["max_abs_diff_vs_base"] = (out - reference).abs().max().item()
                    row["ms"] = timer(call, args.warmup, args.iters)
                    row["ptx"] = ptx_counts(kernel) if device.type == "cuda" else {}
                except Exception as error:  # a variant the compiler refuses
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                rows.append(row)
                diff = f"  diff {row['max_abs_diff_vs_base']:.2e}" if "max_abs_diff_vs_base" in row else ""
                print(f"history {history:>8} {name:<14} "
                      + (f"{row['ms']:8.3f} ms{diff}" if "ms" in row else row["error"]), flush=True)
    write_kernel_report(args, device, rows)


if __name__ == "__main__":
    main()
