"""Packed documents at one long context: oomb's step with attention inside each
document, oomb's step with attention across them, and plain HF stepping over each document alone.

Standard workload, built with `oomb bench`'s helpers (oomb/tools/bench.py:
BenchOptions, build_model, hf_step, measure): Qwen2.5-7B shape with random weights, bf16, one
forward + backward without optimizer, chunk 4096, page 128, fp32 KV gradients, bf16 .grad (no fp32
sums, like HF). One sequence of --context tokens (default 128K) is cut into documents whose lengths
are drawn uniformly from [--min-doc, --max-doc] (default 4K-64K, --seed); the last document is what
is left (it may be shorter). Timed, each after a warm-up on --warmup-tokens tokens (compilation,
Triton autotuning and cuDNN plans of the warm-up's shapes excluded):

* oomb_documents[BACKEND]: ``forward_backward(..., cu_seqlens=...)`` for each of --backends
  (attention inside each document);
* oomb_cross_documents: ``forward_backward`` of the same tokens without boundaries, backend "auto"
  (cudnn for bf16 on CUDA), what a step that ignores the boundaries costs;
* hf_per_document: the sum of plain-HF steps (SDPA + gradient checkpointing + oomb's chunked loss, as
  `oomb bench`'s "hf"), one per document, each measured alone (peak: the largest).

Results are printed and written to --out (JSON: date, machine, commit from $OOMB_GIT_COMMIT, command,
workload, documents, rows) after every measurement.

    PYTHONPATH=. python benchmarks/documents.py --out $OUT/documents_h200.json           # H200, 128K
    PYTHONPATH=. python benchmarks/documents.py --context 1M --offload --kv-grad-dtype bf16 --skip cross \
        --backends triton --out $OUT/documents_h200_1m.json                              # H200, 1M
    PYTHONPATH=. python benchmarks/documents.py --preset tiny-qwen2 --device cpu --context 4096 \\
        --min-doc 256 --max-doc 2048 --chunk-size 512 --page-size 64 --warmup-tokens 1024 \\
        --out /tmp/documents_cpu.json                                                    # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from oomb import machine  # noqa: E402
from oomb.config import BACKENDS  # noqa: E402
from oomb.engine import forward_backward, store_options  # noqa: E402
from oomb.kv.offload import HostSlabs, reserve_host_slabs  # noqa: E402
from oomb.models import unwrap_causal_lm  # noqa: E402
from oomb.planning.memory import GIB  # noqa: E402
from oomb.planning.model_shape import ModelShape  # noqa: E402
from oomb.tools.bench import BenchOptions, build_model, hf_step, measure, token_ids  # noqa: E402
from oomb.tools.plan import parse_tokens  # noqa: E402
from oomb.training.presets import PRESETS  # noqa: E402


def document_lengths(total: int, low: int, high: int, seed: int) -> list[int]:
    """Lengths uniform in [low, high] (seeded) until they cover ``total``; the last is what is left."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        draw = int(torch.randint(low, high + 1, (1,), generator=generator))
        lengths.append(min(draw, total - sum(lengths)))
    return lengths


def cumulative(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-7b")
    parser.add_argument("--context", type=parse_tokens, default=131072, help="tokens of the packed sequence")
    parser.add_argument("--min-doc", type=parse_tokens, default=4096)
    parser.add_argument("--max-doc", type=parse_tokens, default=65536)
    parser.add_argument("--seed", type=int, default=0, help="document lengths and token ids")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=None,
                        help="backends of the document step (default: cudnn triton on CUDA, torch on a CPU)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["documents", "cross", "hf"],
                        help="measurements to leave out")
    parser.add_argument("--chunk-size", type=parse_tokens, default=4096)
    parser.add_argument("--page-size", type=parse_tokens, default=128)
    parser.add_argument("--kv-grad-dtype", default="float32")
    parser.add_argument("--offload", action="store_true",
                        help="keep the pages in pinned host memory (a 1M step of the 7B shape needs it on one H200); "
                             "the host memory is pinned before each timed step")
    parser.add_argument("--warmup-tokens", type=parse_tokens, default=8192)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default="documents.json")
    args = parser.parse_args()
    if not 0 < args.min_doc <= args.max_doc:
        parser.error(f"need 0 < --min-doc <= --max-doc, got {args.min_doc} and {args.max_doc}")

    options = BenchOptions(preset=args.preset, contexts=[args.context], modes=["hf", "dense"], device=args.device,
                           chunk_size=args.chunk_size, page_size=args.page_size, kv_grad_dtype=args.kv_grad_dtype,
                           warmup_tokens=args.warmup_tokens, seed=args.seed)
    device = torch.device(args.device)
    backends = args.backends or (["cudnn", "triton"] if device.type == "cuda" else ["torch"])
    lengths = document_lengths(args.context, args.min_doc, args.max_doc, args.seed)
    cu = cumulative(lengths)
    # The warm-up: two documents (one starts inside a chunk and a page) of the warm-up's length.
    warm = args.warmup_tokens
    warm_cu = [0, min(warm - 1, max(1, warm // 2 + args.page_size // 2 + 1)), warm]

    model = build_model(args.preset, max(args.context, warm), device, options.dtype, args.seed)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    vocab = model.config.vocab_size
    ids = token_ids(vocab, args.context, args.seed, device)
    warm_ids = token_ids(vocab, warm, args.seed, device)
    # The standard workload's OOMBConfig, backend "auto" resolved for the model and device (as its step would).
    shape = ModelShape.from_hf_config(model.config)
    base = options.oomb_config().with_options({"performance.backend": options.backend_for(shape)})
    base = base.with_options({"offload.enabled": args.offload})
    slabs = HostSlabs()  # with --offload: pinned once per size, reused by every step
    gpu = machine.detect_gpu(device) if device.type == "cuda" else None
    report = {
        "benchmark": "packed documents: oomb with document attention vs across documents vs HF per document",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine.machine_info(device, gpu),
        "commit": machine.git_commit() or "unknown",
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "versions": machine.versions(),
        "workload": {"preset": args.preset, "dtype": str(options.dtype).removeprefix("torch."),
                     "step": "one forward+backward, no optimizer", "context": args.context,
                     "oomb_config": {k: str(v) for k, v in dataclasses.asdict(base).items()},
                     "hf": "SDPA + gradient checkpointing + oomb's chunked loss, one step per document",
                     "weights_gib": round(weights / GIB, 3), "warmup_tokens": warm},
        "documents": {"count": len(lengths), "lengths": lengths, "min_doc": args.min_doc, "max_doc": args.max_doc,
                      "seed": args.seed, "sum_of_squares_fraction": round(sum(n * n for n in lengths)
                                                                        / args.context ** 2, 4)},
        "rows": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"{len(lengths)} documents: {lengths}", flush=True)

    def record(name: str, row: dict) -> None:
        report["rows"].append({"name": name, **row})
        out.write_text(json.dumps(report, indent=1))
        if "error" in row:
            print(f"{name}: {row['error']}", flush=True)
            return
        peak = f", peak GPU above weights {row['peak_gpu_above_weights_gib']:.2f} GiB" \
            if "peak_gpu_above_weights_gib" in row else ""
        print(f"{name}: {row['seconds']:.2f} s{peak}, loss {row['loss']:.4f} (warm-up {row['warmup_s']:.1f} s)",
              flush=True)

    def run(name: str, step, warm_step) -> None:
        """Warm up, then time ``step``; an error (e.g. out of memory) is a row, and the next one runs."""
        try:
            start = time.perf_counter()
            warm_step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            warmup_s = round(time.perf_counter() - start, 2)
            row = step()
            row["warmup_s"] = warmup_s
        except Exception as err:  # a result to record, not a reason to lose the other measurements
            row = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        model.zero_grad(set_to_none=True)
        record(name, row)

    def oomb_step(config, boundaries):
        if not config.offload.enabled:
            return lambda m, x: float(forward_backward(m, x, config=config, **boundaries))

        def offload_step(m, x):
            return float(forward_backward(m, x, config=config, host_slabs=slabs, **boundaries))
        return offload_step

    def pin_host(config) -> None:
        """Pin the host memory of the full-length step before it is timed (as `oomb bench` does)."""
        if config.offload.enabled:
            reserve_host_slabs(slabs, resident_layers=config.offload.resident_layers,
                               **store_options(unwrap_causal_lm(model), 1, args.context, config, device))

    def documents(backend: str) -> None:
        config = base.with_options({"performance.backend": backend})
        step, warm_step = oomb_step(config, {"cu_seqlens": cu}), oomb_step(config, {"cu_seqlens": warm_cu})
        run(f"oomb_documents[{backend}]", lambda: measure(step, model, ids, device),
            lambda: (warm_step(model, warm_ids), pin_host(config)))

    # Order: the three comparisons first, then the document step on the other backends (on the H200,
    # Triton's first step autotunes for about 40 s).
    if "documents" not in args.skip:
        documents(backends[0])
    if "cross" not in args.skip:
        step = oomb_step(base, {})
        run(f"oomb_cross_documents[{base.performance.backend}]", lambda: measure(step, model, ids, device),
            lambda: (step(model, warm_ids), pin_host(base)))
    if "hf" not in args.skip:
        def per_document() -> dict:
            rows = [measure(lambda m, x: hf_step(m, x, options.loss_chunk_tokens), model, ids[:, lo:hi], device)
                    for lo, hi in zip(cu[:-1], cu[1:], strict=True)]
            total = {"seconds": round(sum(r["seconds"] for r in rows), 3),
                     "loss": round(sum(r["loss"] * n for r, n in zip(rows, lengths, strict=True)) / args.context, 4),
                     "per_document_seconds": [r["seconds"] for r in rows]}
            if "peak_gpu_above_weights_gib" in rows[0]:
                total["peak_gpu_above_weights_gib"] = max(r["peak_gpu_above_weights_gib"] for r in rows)
            return total

        run("hf_per_document", per_document,
            lambda: hf_step(model, warm_ids[:, :warm_cu[1]], options.loss_chunk_tokens))
    if "documents" not in args.skip:
        for backend in backends[1:]:
            documents(backend)

    rows = {r["name"]: r for r in report["rows"] if "seconds" in r}
    hf = rows.get("hf_per_document", {}).get("seconds")
    cross = next((r["seconds"] for name, r in rows.items() if name.startswith("oomb_cross")), None)
    report["ratios"] = {name: {"vs_cross_documents": round(r["seconds"] / cross, 3) if cross else None,
                               "vs_hf_per_document": round(r["seconds"] / hf, 3) if hf else None}
                        for name, r in rows.items() if name.startswith("oomb_documents")}
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["ratios"]), flush=True)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
