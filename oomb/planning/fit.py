"""Whether a step fits: the memory a step may use (Budget) and the longest context that fits (largest_context).
`oomb plan`, `oomb bench` and the chooser (choose.py) search with these."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import machine
from .memory import GIB

SAFETY_MARGIN = 0.05
"""Fraction of GPU and host memory the planner keeps free: allocator fragmentation and temporaries
the model does not count (measured peaks were within 1-4 % of the predictions)."""
CUDA_CONTEXT_BYTES = GIB // 2
"""Device memory held by the CUDA context and kernel images, outside PyTorch's allocator."""
MAX_SEARCH_TOKENS = 1 << 32
"""Upper end of the largest-context search (4G tokens)."""


@dataclass(frozen=True)
class Budget:
    """GPU and host memory a step may use."""

    gpu_bytes: int
    """Size of the GPU (total device memory)."""
    host_bytes: int
    """Host RAM the step may take (MemAvailable when detected)."""
    gpu_source: str = "given"
    host_source: str = "given"
    margin: float = SAFETY_MARGIN

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin={self.margin} must be in [0, 1)")
        if self.gpu_bytes <= 0 or self.host_bytes <= 0:
            raise ValueError(f"memory sizes must be positive (GPU {self.gpu_bytes}, host {self.host_bytes} bytes)")

    @property
    def gpu_limit(self) -> int:
        return int(self.gpu_bytes * (1 - self.margin)) - CUDA_CONTEXT_BYTES

    @property
    def host_limit(self) -> int:
        return int(self.host_bytes * (1 - self.margin))

    @classmethod
    def detect(cls, gpu_gib: float | None = None, host_gib: float | None = None,
               margin: float = SAFETY_MARGIN) -> Budget:
        """Given sizes (GiB) win; otherwise this machine's GPU (mem_get_info) and MemAvailable."""
        if gpu_gib is not None:
            gpu, gpu_source = int(gpu_gib * GIB), "given"
        else:
            info = machine.detect_gpu()
            if info is None:
                raise ValueError("no CUDA device on this machine: give the GPU size with --gpu-gib "
                                 "(e.g. --gpu-gib 139 for an H200, 79 for an H100 80GB)")
            gpu, gpu_source = info.total_bytes, f"detected: {info.name}"
        if host_gib is not None:
            host, host_source = int(host_gib * GIB), "given"
        else:
            available = machine.host_available_bytes()
            if available is None:
                raise ValueError("cannot read MemAvailable from /proc/meminfo: give the host RAM with --host-gib")
            host, host_source = available, "detected: MemAvailable"
        return cls(gpu, host, gpu_source, host_source, margin)


def largest_context(fits: Callable[[int], bool], step: int, limit: int = MAX_SEARCH_TOKENS) -> int:
    """The largest multiple of ``step`` (at most ``limit``) for which ``fits`` holds; 0 if none.

    ``fits`` must be monotone (true up to some length, false beyond): memory grows with the context.
    """
    if not fits(step):
        return 0
    n_max = limit // step
    lo, hi = 1, 2  # lo * step fits; hi * step does not, or is past the limit
    while hi <= n_max and fits(hi * step):
        lo, hi = hi, hi * 2
    hi = min(hi, n_max + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid
    return lo * step
