"""Host pages read and written by GPU kernels directly (unified virtual addressing).

A sparse call stages a few hundred scattered pages per layer. One ``cudaMemcpyAsync`` per run of
consecutive pages costs tens of microseconds of Python and driver time each, thousands per layer
at long contexts: the step became bound by issuing copies. Registered host memory is mapped into
the GPU's address space, so a CUDA tensor aliasing a slab lets one ``index_select`` kernel gather
all of a call's pages over PCIe and one ``index_copy_`` kernel scatter its gradients back.

``mapped_view`` checks once per slab that a kernel really reads and writes the host bytes; if the
device cannot, callers fall back to copies per run.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_PROBE_BYTES = 4096


class _CudaArray:
    """The minimal ``__cuda_array_interface__`` torch needs to alias memory it did not allocate."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
                                         "version": 2, "strides": None}


def pointer_attributes(tensor: torch.Tensor) -> tuple[int, int | None]:
    """(memory type, device pointer) of a tensor's memory from ``cudaPointerGetAttributes`` of the CUDA
    runtime torch loaded. Type 1 is page-locked host memory (``Tensor.is_pinned`` says False for
    memory pinned by ``cudaHostRegister``), 0 unregistered host memory; the device pointer is where
    kernels address the memory (None: they cannot)."""
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
    if not paths:
        raise RuntimeError("libcudart is not loaded as a shared library in this process")
    cudart = ctypes.CDLL(paths.pop())

    class PointerAttributes(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                    ("device_pointer", ctypes.c_void_p), ("host_pointer", ctypes.c_void_p),
                    ("reserved", ctypes.c_long * 16)]  # room for fields newer CUDA versions add

    attributes = PointerAttributes()
    error = cudart.cudaPointerGetAttributes(ctypes.byref(attributes), ctypes.c_void_p(tensor.data_ptr()))
    if error != 0:
        raise RuntimeError(f"cudaPointerGetAttributes failed (cudaError {error})")
    return attributes.type, attributes.device_pointer


def mapped_view(slab: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA uint8 tensor over the bytes of ``slab`` (a registered, page-locked CPU byte tensor), or
    None when kernels on ``device`` cannot address it. The caller keeps ``slab`` alive."""
    if device.type != "cuda" or slab.numel() < 2 * _PROBE_BYTES:
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        memory_type, device_pointer = pointer_attributes(slab)
        if memory_type != 1 or not device_pointer:
            raise RuntimeError(f"the slab is not mapped (memory type {memory_type})")
        with torch.cuda.device(device):
            alias = torch.as_tensor(_CudaArray(device_pointer, slab.numel()))  # no device=: never a copy
            if alias.device != device:
                raise RuntimeError(f"the slab is mapped for {alias.device}, not {device}")
            if not _kernels_reach(slab, alias):
                raise RuntimeError("a kernel read or wrote other bytes than the host's")
    except Exception as err:  # e.g. a device without host-pointer access to registered memory
        logger.warning("sparse offload stages pages with one copy per run: no mapped host memory (%s)", err)
        return None
    return alias


def _kernels_reach(slab: torch.Tensor, alias: torch.Tensor) -> bool:
    """Write a pattern on the host, read it in a kernel; add in a kernel, read it on the host."""
    pattern = (torch.arange(2 * _PROBE_BYTES) % 251).to(torch.uint8)
    slab[:2 * _PROBE_BYTES].copy_(pattern)
    seen = alias[:_PROBE_BYTES].to(torch.int32).cpu()  # an elementwise kernel, not a memcpy
    alias[_PROBE_BYTES:2 * _PROBE_BYTES].add_(1)
    torch.cuda.synchronize(alias.device)
    wrote = slab[_PROBE_BYTES:2 * _PROBE_BYTES].to(torch.int32)
    return torch.equal(seen, pattern[:_PROBE_BYTES].to(torch.int32)) and torch.equal(
        wrote, pattern[_PROBE_BYTES:].to(torch.int32) + 1)


def rows_of(pages: torch.Tensor) -> torch.Tensor:
    """``pages`` (n, ...) as n rows of 8-byte words where the page size allows (wider loads and
    stores over PCIe than 2-byte elements), else as n rows of its own dtype."""
    flat = pages.view(pages.shape[0], -1)
    if flat.shape[1] * flat.element_size() % 8 == 0 and flat.is_contiguous():
        return flat.view(torch.int64)
    return flat


def index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 indices on ``device``, copied from page-locked memory so the copy does not block."""
    host = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
