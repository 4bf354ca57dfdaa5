"""Will a step's pages fit? Checked before anything is allocated, and reused by the planner.

A step's pages (K, V, dK, dV of every token and layer) go to the GPU, or with offload to pinned
host memory (offloaded sliding-window layers: only their window slots, kv/window_slots.py). When they
do not fit, the step stops before allocating with the bytes needed and available and the options that
would fit (bf16 page gradients, offload, both).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..config import OOMBConfig
from .store import window_pages_per_sequence

GIB = 1024**3
HEADROOM = 0.95
"""Fraction of the free memory the pages may take: the rest is for activations and fragmentation."""


class PagesDoNotFitError(MemoryError):
    """The KV pages of a step need more GPU or host memory than is available."""


@dataclass(frozen=True)
class PageFootprint:
    """Bytes of one step's pages on the GPU and on the host for one configuration."""

    gpu: int
    host: int


@dataclass(frozen=True)
class PageShape:
    """What the page bytes depend on besides the config."""

    num_layers: int
    batch_size: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype
    window_layers: tuple[int, ...] = ()
    """The layers with their own sliding-window pages (engine.window_store_options; none under context
    parallelism): offloaded, they keep host slots of their window, not of every token."""
    window: int = 0
    """Their (largest) sliding window, when ``window_layers``."""


def page_bytes(shape: PageShape, config: OOMBConfig, num_layers: int) -> tuple[int, int]:
    """(K + V bytes, dK + dV bytes) of every page of ``num_layers`` layers."""
    elements = num_layers * 2 * shape.batch_size * -(-shape.num_tokens // config.page_size) * (
        shape.num_kv_heads * config.page_size * shape.head_dim)
    return elements * shape.kv_dtype.itemsize, elements * config.precision.grad_dtype.itemsize


def offloaded_layers(shape: PageShape, config: OOMBConfig) -> int:
    """Layers whose pages live in host memory."""
    return shape.num_layers - min(config.offload.resident_layers, shape.num_layers) if config.offload.enabled else 0


def host_page_bytes(shape: PageShape, config: OOMBConfig) -> tuple[int, int]:
    """(K + V bytes, dK + dV bytes) of the host tier (kv/offload.py ``reserve_host_slabs``): every page
    of the offloaded global layers, and ``window_pages_per_sequence`` slots per sequence of the offloaded
    window layers (their chunk tails and one chunk, kv/window_slots.py)."""
    host_layers = offloaded_layers(shape, config)
    windowed = sum(layer >= shape.num_layers - host_layers for layer in shape.window_layers) if host_layers else 0
    kv, grad = page_bytes(shape, config, host_layers - windowed)
    if windowed:
        slots = window_pages_per_sequence(shape.num_tokens, config.chunk_size, config.page_size, shape.window)
        window_kv, window_grad = page_bytes(replace(shape, num_tokens=slots * config.page_size), config, windowed)
        kv, grad = kv + window_kv, grad + window_grad
    return kv, grad


def page_footprint(shape: PageShape, config: OOMBConfig) -> PageFootprint:
    """Pool bytes of a step (not the GPU staging buffers of offload, which do not grow with context).
    Without offload window layers are counted with every page (their own pool is smaller: kv/store.py)."""
    host_layers = offloaded_layers(shape, config)
    return PageFootprint(gpu=sum(page_bytes(shape, config, shape.num_layers - host_layers)),
                         host=sum(host_page_bytes(shape, config)))


def check_pages_fit(shape: PageShape, config: OOMBConfig, gpu_free: int | None, host_free: int | None,
                    host_held: int = 0) -> None:
    """Raise PagesDoNotFitError naming bytes needed/available and the options that would fit.

    ``gpu_free``/``host_free``: available bytes, None when unknown (that side is not checked).
    ``host_held``: pinned host bytes kept from an earlier step (kv/host_slabs.py), reused without a new
    allocation: only what the pages need beyond them must fit the available memory, with its headroom.
    """
    problems = _problems(page_footprint(shape, config), gpu_free, host_free, host_held)
    if not problems:
        return
    alternatives = []
    bf16 = {"precision.kv_grad_dtype": "bfloat16"}
    offload = {"offload.enabled": True, "offload.resident_layers": 0}
    for name, option in (("precision.kv_grad_dtype='bfloat16'", bf16),
                         ("offload.enabled=True", offload),
                         ("offload.enabled=True, precision.kv_grad_dtype='bfloat16'", {**offload, **bf16})):
        candidate = config.with_options(option)
        if candidate != config and not _problems(page_footprint(shape, candidate), gpu_free, host_free, host_held):
            alternatives.append(name)
    advice = (f"options that would fit: {'; '.join(alternatives)}" if alternatives else
              "no page option fits: use fewer tokens per step (or a machine with more memory)")
    raise PagesDoNotFitError(
        f"the KV pages of {shape.batch_size} x {shape.num_tokens:,} tokens do not fit: " + "; ".join(problems)
        + f"\n  {advice}")


def _problems(need: PageFootprint, gpu_free: int | None, host_free: int | None, host_held: int = 0) -> list[str]:
    problems = []
    if gpu_free is not None and need.gpu > HEADROOM * gpu_free:
        problems.append(f"GPU needs {need.gpu / GIB:.2f} GiB, {gpu_free / GIB:.2f} GiB available")
    if host_free is not None and need.host - host_held > HEADROOM * host_free:
        held = f" ({host_held / GIB:.2f} GiB of it pinned already)" if host_held else ""
        problems.append(f"host RAM needs {need.host / GIB:.2f} GiB{held}, {host_free / GIB:.2f} GiB "
                        f"{'more ' if host_held else ''}available")
    return problems
