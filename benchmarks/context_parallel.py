"""Context parallel vs one GPU: step time and per-GPU peak memory of oomb's step (dense by default;
--attention sparse, --offload: pages in each rank's pinned host memory).

Standard workload: Qwen2.5-7B shape with random weights (built locally, no
download), bf16, one forward + backward without optimizer, chunk 4096, page 128, fp32 KV gradients.
The processes form one context-parallel group (--tp splits each cp rank's heads further: the
process count is cp x tp); --cp-one-path runs one process through the context-parallel code path
(a group of one) to check that it costs nothing against today's step:

    torchrun --nproc-per-node 1 benchmarks/context_parallel.py --contexts 131072 --out cp1.json
    torchrun --nproc-per-node 1 benchmarks/context_parallel.py --cp-one-path --offload --attention sparse \
        --contexts 131072 --out cp1_sparse_offload.json      # the cp code path of sparse + offload, one GPU
    torchrun --nproc-per-node 4 benchmarks/context_parallel.py --contexts 131072 1048576 --out cp4.json
    torchrun --nproc-per-node 8 benchmarks/context_parallel.py --tp 2 --contexts 1048576 --out cp4_tp2.json
    torchrun --nproc-per-node 2 benchmarks/context_parallel.py --preset tiny-qwen2 --contexts 2048 \\
        --device cpu --chunk-size 256 --warmup-tokens 512 --out /tmp/cp2.json     # CPU smoke test (gloo)

Each context is timed after a warm-up step (Triton compilation and autotuning excluded), with the
devices synchronised and peak statistics reset. Memory is each rank's peak above its own weights,
and the pages its store allocated (with --offload also its pinned host slabs). Rank 0 prints and
writes OUT (JSON) after every context.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from parallel import base_report, time_contexts  # noqa: E402  (benchmarks/parallel.py, this script's folder)

import oomb.engine  # noqa: E402
from oomb.config import OffloadConfig, OOMBConfig, PerformanceConfig, PrecisionConfig, SparseConfig  # noqa: E402
from oomb.context_parallel import ContextShard  # noqa: E402
from oomb.engine import forward_backward  # noqa: E402
from oomb.kv.offload import HostSlabs  # noqa: E402
from oomb.parallel import ParallelConfig, ParallelSetup, init_distributed, setup_parallel  # noqa: E402
from oomb.tools.bench import build_model  # noqa: E402
from oomb.training.presets import PRESETS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description="oomb step: context parallel over the torchrun processes")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-7b")
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree inside each cp rank")
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--kv-grad-dtype", default="float32")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--attention", choices=["dense", "sparse"], default="dense")
    parser.add_argument("--sparse-budget", type=int, default=64)
    parser.add_argument("--sparse-score", default="auto")
    parser.add_argument("--offload", action="store_true", help="each rank keeps its own pages in pinned host memory")
    parser.add_argument("--warmup-tokens", type=int, default=8192)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--cp-one-path", action="store_true",
                        help="one process through the context-parallel code path (a CP group of one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="context_parallel.json")
    args = parser.parse_args()

    world = init_distributed(args.device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.preset, max(args.contexts + [args.warmup_tokens]), device, dtype, args.seed)
    cp = world // args.tp
    config = OOMBConfig(chunk_size=args.chunk_size, page_size=args.page_size, attention=args.attention,
                        sparse=SparseConfig(budget=args.sparse_budget, score=args.sparse_score),
                        precision=PrecisionConfig(kv_grad_dtype=args.kv_grad_dtype),
                        performance=PerformanceConfig(backend=args.backend),
                        offload=OffloadConfig(enabled=args.offload))
    slabs = HostSlabs() if args.offload else None  # pinned once, reused by every step
    if args.cp_one_path:
        if world != 1:
            raise SystemExit("--cp-one-path runs one process")
        # Under torchrun the rendezvous is its store (env://: an explicit tcp:// address would wait, as a
        # client of torchrun's agent store, for a server that never starts); alone, a local one.
        init = "env://" if "MASTER_ADDR" in os.environ else "tcp://127.0.0.1:29511"
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init, rank=0, world_size=1)
        setup = _one_rank_cp_setup()
    else:
        setup = setup_parallel(model, tp=args.tp, cp=cp, device_type=device.type)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    pages = []

    def step(m, ids):
        return float(forward_backward(m, ids, config=config, parallel=setup, host_slabs=slabs))

    real_make_store = oomb.engine.make_step_store

    def make_store(*a, **k):  # records the pages each step's store allocated on this rank
        store = real_make_store(*a, **k)
        pages.append(store.pool.capacity)
        return store

    oomb.engine.make_step_store = make_store
    report = base_report(f"oomb {args.attention} step, context parallel", args, dtype, device, weights, cp=cp,
                         tp=args.tp, cp_one_path=args.cp_one_path, backend=args.backend, attention=args.attention,
                         offload=args.offload)
    time_contexts(step, model, args, device, report, world, rank, f"cp={cp} tp={args.tp}",
                  row_extras=lambda: {"store_pages": pages[-1],
                                      "host_slab_gib": slabs.nbytes / 2**30 if slabs is not None else 0.0},
                  describe=lambda rows: f", pages per rank {[r.get('store_pages') for r in rows]}")
    if dist.is_initialized():
        dist.destroy_process_group()


def _one_rank_cp_setup() -> ParallelSetup:
    """A ParallelSetup whose attention runs the context-parallel hooks over a group of one process:
    its merge, sum and broadcast are collectives of one rank (the overhead the check measures)."""

    class OneRankCP(ParallelSetup):
        def context_shard(self, chunk_size: int) -> ContextShard:
            return ContextShard(0, 1, chunk_size, dist.group.WORLD)

    return OneRankCP(ParallelConfig())


if __name__ == "__main__":
    main()
