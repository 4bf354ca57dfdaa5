"""How long a step will take: the FLOPs it executes (step_work.py) over a rate measured on the same kind of GPU.

`oomb bench` reports each step's executed TFLOP/s: the linear layers with every recomputation and replay,
attention, sparse scoring and the loss, as step_work.py counts them. On the 7B shape the rates measured span
468-525 TFLOP/s on both the H100 and the H200 for every mode, from 128K to 1M tokens (the H100's sparse step
reading a quarter of the history ran at 468, 3 % under the rate its prediction uses). Elsewhere (another GPU,
a much smaller model, short contexts where fixed costs dominate) the prediction is an extrapolation and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import OOMBConfig
from .model_shape import ModelShape
from .step_work import StepSpec, step_work


@dataclass(frozen=True)
class MeasuredRate:
    """Executed TFLOP/s of `oomb bench --chosen` steps of one GPU kind and mode, and where they came from."""

    gpu: str
    attention: str
    offload: bool
    tflops: float
    """Executed TFLOP/s of the measured step."""
    measured: str
    source: str
    plan_relative_time: float = 1.0
    """The chooser's relative step time of the measured step's plan (planning/choose.py): a plan is predicted at
    its own relative time over this one's, so a measured plan that paid for offload is not charged twice."""


RATES: tuple[MeasuredRate, ...] = (
    MeasuredRate("H100", "dense", False, 524.4, "7B shape, 128K, 43.46 s", "sparse_reads_7b_128k_b64_h100.json"),
    MeasuredRate("H100", "sparse", False, 483.5, "7B shape, 128K, budget 64, 21.66 s",
                 "sparse_reads_7b_128k_b64_h100.json"),
    MeasuredRate("H100", "sparse", True, 445.7, "7B shape, 1M, budget 64, 6 of 28 layers resident, 196.74 s",
                 "train_vs_bench_qwen2.5-7b_1m_sparse_lora_bench_h100.json", plan_relative_time=1.104),
    MeasuredRate("H200", "dense", False, 525.3, "7B shape, 512K, 529.08 s", "dense_chosen_512k_h200_2026-12-04.json",
                 plan_relative_time=1.01),
    MeasuredRate("H200", "sparse", True, 472.5, "7B shape, 1M, 20 of 28 layers resident, 185.58 s",
                 "sparse_offload_chosen_candidates_softmax_max_256_1m_h200_2026-12-05.json", plan_relative_time=1.009),
)
"""One per measured (GPU kind, attention, offload); files in benchmarks/results/."""


@dataclass(frozen=True)
class StepTime:
    """A predicted step time and what it rests on."""

    seconds: float
    rate: MeasuredRate
    basis: str
    """Which measurement it scales, and how far (another GPU kind or mode) it reaches."""

    def __str__(self) -> str:
        return f"~{format_duration(self.seconds)} a step ({self.basis})"


def format_duration(seconds: float) -> str:
    """'42 s', '3.5 min', '1.2 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


GPU_MEMORY_GIB = {"H100": 79.6, "H200": 140.4}
"""Total memory of the measured kinds (H100 80GB: 81,559 MiB; H200: 143,771 MiB, as nvidia-smi reports them):
the GPU size `oomb plan --gpu NAME` plans for on a machine without that card."""


def gpu_kind(name: str | None) -> str | None:
    """"H100" or "H200" from a CUDA device name; None for any other device."""
    for kind in ("H200", "H100"):
        if name and kind in name.upper():
            return kind
    return None


def _rate(kind: str, attention: str, offload: bool) -> MeasuredRate:
    """The closest measured rate: same kind and mode, else same kind and attention, else any kind's same mode."""
    def distance(rate: MeasuredRate) -> tuple[int, int, int]:
        return (rate.gpu != kind, rate.attention != attention, rate.offload != offload)

    return min(RATES, key=distance)


def predict_step_time(shape: ModelShape, tokens: int, config: OOMBConfig, *, gpu_name: str | None,
                      lora_rank: int = 0, dtype: torch.dtype = torch.bfloat16, batch_size: int = 1,
                      fused_loss: bool = True, relative_time: float = 1.0) -> StepTime | None:
    """The step's executed FLOPs over the nearest measured rate; None on a CPU (no rate is measured there).

    The rates were measured on the chooser's fastest plans (no layer replay, cuDNN); ``relative_time`` (the
    chooser's relative step time of this plan, planning/choose.py) over the measured plan's scales the result
    for what this plan does differently: the FLOPs are counted without a replay, which the relative time
    already prices."""
    if gpu_name is None:
        return None
    kind = gpu_kind(gpu_name)
    rate = _rate(kind or "H100", config.attention, config.offload.enabled)
    no_replay = config.with_options({"performance.checkpoint_layers": False, "performance.compile_layers": None})
    spec = StepSpec.from_config(shape, tokens, no_replay, batch_size=batch_size, lora_rank=lora_rank, dtype=dtype,
                                fused_loss=fused_loss)
    flops = sum(work.flops for work in step_work(spec).values())
    mode = config.attention + ("+offload" if config.offload.enabled else "")
    rate_mode = rate.attention + ("+offload" if rate.offload else "")
    basis = f"{flops / 1e15:,.0f} PFLOP at {rate.tflops:.0f} TFLOP/s, the rate of a {rate_mode} step on an {rate.gpu}"
    scale = relative_time / rate.plan_relative_time
    if round(scale, 2) != 1.0:
        basis += f", x {scale:.2f} for this plan's options"
        if rate.plan_relative_time != 1.0:
            basis += f" ({relative_time:.2f} against the measured plan's {rate.plan_relative_time:.2f})"
    if kind is None:
        basis += f"; {gpu_name} is not measured: scale by its bf16 throughput against the H100's"
    elif rate.gpu != kind or rate_mode != mode:
        basis += f"; no {mode} step on an {kind} is measured"
    return StepTime(scale * flops / (rate.tflops * 1e12), rate, basis)
