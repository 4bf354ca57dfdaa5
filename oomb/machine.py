"""What this machine has: GPU and host memory, names and versions, and per-process peak host memory.

Host peaks come from Linux's /proc: writing "5" to /proc/self/clear_refs resets the process's
high-water mark (VmHWM) to its current resident size, so a peak can be measured per step inside one
long-lived process. Elsewhere the fallback is ``getrusage``'s lifetime maximum.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import os
import platform
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .version import __version__

PROC_MEMINFO = Path("/proc/meminfo")
PROC_STATUS = Path("/proc/self/status")
PROC_CLEAR_REFS = Path("/proc/self/clear_refs")
RESET_PEAK_RSS = "5"  # clear_refs command: reset VmHWM to the current RSS (Linux >= 4.0)
KIB = 1024


@dataclass(frozen=True)
class GpuInfo:
    name: str
    total_bytes: int
    free_bytes: int


def detect_gpu(device: int | str | torch.device | None = None) -> GpuInfo | None:
    """Name and memory of a CUDA device (creates its context), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda") if device is None else torch.device(device)
    free, total = torch.cuda.mem_get_info(device)
    return GpuInfo(torch.cuda.get_device_name(device), total, free)


def gpu_free_bytes(device: int | str | torch.device | None = None) -> int:
    """GPU memory an allocation could get now: what the driver reports free plus what PyTorch's caching
    allocator holds unused (it hands those blocks out again, and releases them to the driver before an
    allocation fails). The driver's figure alone misses a freed step's pages: a second step would see
    the first one's 84 GiB of 1M-token pages as taken."""
    device = torch.device("cuda") if device is None else torch.device(device)
    free = torch.cuda.mem_get_info(device)[0]
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _meminfo_bytes(key: str) -> int | None:
    try:
        for line in PROC_MEMINFO.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * KIB
    except OSError:
        return None
    return None


def host_available_bytes() -> int | None:
    """Memory the kernel could hand out now without swapping (MemAvailable), or None off Linux."""
    return _meminfo_bytes("MemAvailable")


def host_free_bytes() -> int:
    """Memory the kernel could hand out now (MemAvailable), else free physical pages (off Linux)."""
    available = host_available_bytes()
    return available if available is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_total_bytes() -> int | None:
    return _meminfo_bytes("MemTotal")


def _status_bytes(key: str) -> int | None:
    try:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * KIB
    except OSError:
        return None
    return None


def current_rss_bytes() -> int | None:
    return _status_bytes("VmRSS")


def reset_peak_rss() -> bool:
    """Reset this process's peak resident size to its current size; False where that is impossible."""
    try:
        PROC_CLEAR_REFS.write_text(RESET_PEAK_RSS)
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident size since the last reset_peak_rss (or since the process started)."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    scale = 1 if sys.platform == "darwin" else KIB  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
HEAP_MMAP_THRESHOLD = 4 << 20
"""Allocations from this size on get their own mapping, returned to the system when freed. glibc's default
threshold rises to the largest block freed (up to 32 MiB on 64-bit), after which a CPU step's tensors come from
the heap, which keeps freed memory: SmolLM2-135M LoRA at 8K peaked at 10.1 GB of RSS so, 3.6 GB with this
threshold (2.6 GB with 64 KiB, but 27 % slower; 4 MiB took the same time), on a 2-core CPU."""


def bound_heap_retention(threshold: int = HEAP_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold (HEAP_MMAP_THRESHOLD) for this process, so a long CPU step's freed tensors go
    back to the system instead of staying in the heap. True where it was set (Linux with glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit(path: Path | None = None) -> str | None:
    """The commit of the working tree holding this package (with "+dirty" when it has changes), or
    $OOMB_GIT_COMMIT where the tree is a copy without .git (e.g. on a GPU machine)."""
    if os.environ.get("OOMB_GIT_COMMIT"):
        return os.environ["OOMB_GIT_COMMIT"]
    root = path or Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def versions() -> dict:
    """Versions of what a measurement depends on."""
    return {
        "oomb": __version__,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "peft": _version("peft"),
    }


def machine_info(device: torch.device, gpu: GpuInfo | None = None) -> dict:
    """The machine a measurement ran on. The GPU is described only when ``gpu`` is given: probing it
    here would create a CUDA context (and take GPU memory) in the calling process."""
    total = host_total_bytes()
    info = {
        "device": device.type,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "host_memory_gib": round(total / 1024**3, 1) if total else None,
        "platform": platform.platform(),
    }
    if gpu is not None:
        info.update(gpu=gpu.name, gpu_memory_gib=round(gpu.total_bytes / 1024**3, 1),
                    gpu_count=torch.cuda.device_count())
    return info
