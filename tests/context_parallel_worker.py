"""Worker of tests/test_context_parallel.py: one process of a 2-, 3- or 4-rank group (gloo on the
CPU, NCCL on GPUs).

Each scenario builds the same tiny model on every rank, runs the single-process oomb step on one
copy (the reference, itself checked against a full-sequence Hugging Face backward) and the
context-parallel step on another, and reports per rank: the relative error of the gradients, the
loss, a hash of every gradient's bytes (ranks must agree bit for bit) and the pages the rank's
store allocated. The offload and sparse scenarios (``variants``) run one reference and several
context-parallel configurations, and also report a hash of every page selection and the pages of
the host slabs. Every rank's results go to a JSON file the test reads.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from helpers import (
    TINY,
    build_tiny_model,
    grads,
    hf_step,
    perturb_,
    random_ids,
    relative_error,
    run_distributed_worker,
)
from transformers import Gemma2Config, Gemma2ForCausalLM

import oomb.engine
from oomb import OOMBConfig, forward_backward
from oomb.config import PerformanceConfig
from oomb.kv import PagedKVStore
from oomb.kv.offload import HostSlabs
from oomb.parallel import full_tensor, setup_parallel

CONFIG = OOMBConfig(chunk_size=16, page_size=8, performance=PerformanceConfig(backend="torch"))
# history windows of one page: cut at chunk boundaries
STREAMED = CONFIG.with_options({"offload.stream_block_pages": 1})
TOKENS = 75  # 5 chunks of 16, the last one 11 tokens: a partial chunk and a partial page


GEMMA2 = dict(head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
              sliding_window=20)
"""gemma2's options (as tests/test_families.py): strong caps, so that they matter; layer 0 slides, layer 1 is global."""
GEMMA2_QUERY_GAIN = 40.0
"""gemma2's query weights are scaled by this: random weights give scores far below its attention softcap."""


def build_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """helpers.build_tiny_model, and a tiny gemma2 (attention logit softcapping) built the same way."""
    if family != "gemma2":
        return build_tiny_model(family, seed, **overrides)
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(Gemma2Config(**{**TINY, **GEMMA2, **overrides}))
    perturb_(model, seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(GEMMA2_QUERY_GAIN)
    return model


def _gathered_grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else full_tensor(p.grad).detach().clone() for n, p in model.named_parameters()}


def _digest(named: dict[str, torch.Tensor | None]) -> str:
    h = hashlib.sha256()
    for name, g in sorted(named.items()):
        h.update(name.encode())
        if g is not None:
            h.update(g.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class _StoreSpy:
    """Records the page store of every step (its pool capacity is what the rank allocated)."""

    def __init__(self) -> None:
        self.stores = []
        self._real = oomb.engine.make_step_store

    def __enter__(self):
        def make_store(*args, **kwargs):
            store = self._real(*args, **kwargs)
            self.stores.append(store)
            return store

        oomb.engine.make_step_store = make_store
        return self

    def __exit__(self, *exc) -> None:
        oomb.engine.make_step_store = self._real


class _SelectionSpy:
    """Records every page selection stage 1 keeps, in order (a hash of their values)."""

    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.sparse_calls = 0  # selections that leave pages out (None: the chunk reads every page)
        self._real = PagedKVStore.save_selection

    def __enter__(self):
        spy = self

        def save_selection(store, layer, chunk, selection):
            values = "dense" if selection is None else selection.cpu().tolist()
            spy.hash.update(repr((chunk.index, layer, values)).encode())
            spy.sparse_calls += selection is not None
            return spy._real(store, layer, chunk, selection)

        PagedKVStore.save_selection = save_selection
        return self

    def __exit__(self, *exc) -> None:
        PagedKVStore.save_selection = self._real


def _own_pages(setup, tokens: int, config: OOMBConfig) -> int:
    chunks = -(-tokens // config.chunk_size)
    own = [c for c in range(chunks) if c % setup.cp == setup.cp_rank]
    return sum(-(-min((c + 1) * config.chunk_size, tokens) // config.page_size) - c * config.chunk_size
               // config.page_size for c in own)


def variants(rank: int, world: int, device: torch.device, family: str, reference: OOMBConfig,
             configs: dict[str, OOMBConfig], *, batch: int = 2, tokens: int = TOKENS, copy_runs: bool = False,
             documents: bool = False) -> dict:
    """One single-process step with ``reference``, then a cp = world step with each of ``configs``: per
    config the gradient error against the reference, the loss, the gradients' digest, a digest of the
    page selections (the reference's too) and the rank's pool and host-slab pages (per sequence).
    ``copy_runs``: offload copies pages run by run (devices that cannot map the host slabs)."""
    ids = random_ids(batch, tokens, seed=11).to(device)
    kwargs = {}
    if documents:  # packed documents, boundaries inside chunks and pages
        starts = [0, 27, 44]
        positions = torch.cat([torch.arange(b - a) for a, b in zip(starts, [*starts[1:], tokens], strict=True)])
        kwargs["position_ids"] = positions.expand(batch, -1).to(device)
    single = build_model(family).to(device)
    with _SelectionSpy() as selections:
        want_loss = float(forward_backward(single, ids, config=reference, **kwargs))
    want = grads(single)
    results = {"reference": {"selections": selections.hash.hexdigest(), "sparse_calls": selections.sparse_calls,
                             "loss": want_loss}}
    real_mapped = HostSlabs.mapped
    if copy_runs:
        HostSlabs.mapped = lambda *args: None
    try:
        for name, config in configs.items():
            model = build_model(family).to(device)
            setup = setup_parallel(model, cp=world)
            with _StoreSpy() as stores, _SelectionSpy() as selections:
                loss = float(forward_backward(model, ids, config=config, parallel=setup, **kwargs))
            got = _gathered_grads(model)
            store = stores.stores[0]
            results[name] = {
                "error": relative_error(got, want), "loss": loss, "digest": _digest(got),
                "selections": selections.hash.hexdigest(), "sparse_calls": selections.sparse_calls,
                "pool_pages": store.pool.capacity, "own_pages": batch * max(_own_pages(setup, tokens, config), 1),
                "host_pages": getattr(store, "host_pages", None), "own_host_pages": _own_pages(setup, tokens, config),
            }
    finally:
        HostSlabs.mapped = real_mapped
    return results


SPARSE = STREAMED.with_options({"attention": "sparse", "sparse.budget": 2, "sparse.sink_pages": 1,
                                "sparse.research.rerank_factor": 2})
"""Rerank (the default score): 5 candidates of up to 8 history pages, 3 pages read per query block."""


def context_parallel(rank: int, world: int, device: torch.device, family: str, *, batch: int = 2, tokens: int = TOKENS,
                     config: OOMBConfig = STREAMED, tp: int = 1, dp: int = 1, documents: bool = False,
                     **overrides) -> dict:
    """cp = world / (tp * dp) ranks per batch (dp > 1: dp groups, one row each): gradients against the
    single-process oomb step over the whole batch."""
    ids = random_ids(batch, tokens, seed=7).to(device)
    kwargs = {}
    if documents:  # packed documents: positions restart at 0 inside chunks and inside pages
        starts = [0, 21, 40]
        positions = torch.cat([torch.arange(b - a) for a, b in zip(starts, [*starts[1:], tokens], strict=True)])
        kwargs["position_ids"] = positions.expand(batch, -1).to(device)
    hf = build_model(family, **overrides).to(device)
    hf_loss = None
    if not documents:
        hf_loss = float(hf_step(hf, ids, ids))
    single = build_model(family, **overrides).to(device)
    want_loss = float(forward_backward(single, ids, config=config, **kwargs))
    want = grads(single)
    model = build_model(family, **overrides).to(device)
    setup = setup_parallel(model, tp=tp, dp=dp, cp=world // (tp * dp))
    rows = slice(setup.dp_rank * batch // dp, (setup.dp_rank + 1) * batch // dp)
    kwargs = {name: value[rows] for name, value in kwargs.items()}
    with _StoreSpy() as spy:
        loss = setup.all_mean(float(forward_backward(model, ids[rows], config=config, parallel=setup, **kwargs)))
    got = _gathered_grads(model)
    store = spy.stores[0]
    chunks = -(-tokens // config.chunk_size)
    own = [c for c in range(chunks) if c % setup.cp == setup.cp_rank]
    own_pages = sum(-(-min((c + 1) * config.chunk_size, tokens) // config.page_size) - c * config.chunk_size
                    // config.page_size for c in own)
    return {
        "error": relative_error(got, want),
        "single_vs_hf": None if documents else relative_error(want, grads(hf)),
        "loss": float(loss), "want_loss": want_loss, "hf_loss": hf_loss,
        "digest": _digest(got),
        "pool_pages": store.pool.capacity, "own_pages": batch // dp * max(own_pages, 1),
        "full_pages": batch * -(-tokens // config.page_size),
        "cp_rank": setup.cp_rank,
    }


def refusals(rank: int, world: int, device: torch.device) -> dict:
    """What context parallelism refuses, before anything is allocated (no collective runs)."""
    model = build_tiny_model("llama").to(device)
    setup = setup_parallel(model, cp=world)
    ids = random_ids(1, 40, seed=1).to(device)
    messages = {}
    exact_softmax = CONFIG.with_options({"attention": "sparse", "sparse.budget": 2, "sparse.score": "exact",
                                         "sparse.research.pooling": "softmax"})
    for name, config in {"exact_softmax": exact_softmax}.items():
        try:
            forward_backward(model, ids, config=config, parallel=setup)
            messages[name] = None
        except NotImplementedError as err:
            messages[name] = str(err)
    dist.barrier()
    return messages


SCENARIOS = {
    # Batch 2, ragged (partial chunk and page), history windows of one page cut at chunk boundaries.
    "llama_batch2": lambda rank, world, device: context_parallel(rank, world, device, "llama"),
    # One history window per chunk (cut into the rank's own chunks), q/k/v biases, a tied head.
    "qwen2_tied": lambda rank, world, device: context_parallel(rank, world, device, "qwen2", batch=1, config=CONFIG,
                                                       tie_word_embeddings=True),
    # Packed documents (masks by position inside every rank's windows) without layer checkpointing.
    "llama_documents": lambda rank, world, device: context_parallel(
        rank, world, device, "llama", batch=1, documents=True,
        config=STREAMED.with_options({"performance.checkpoint_layers": False})),
    # Sliding-window layers: the windows start at each chunk's first visible page.
    "mistral_window": lambda rank, world, device: context_parallel(rank, world, device, "mistral", sliding_window=20),
    # One chunk only: every rank but the owner holds no page of the step.
    "one_chunk": lambda rank, world, device: context_parallel(rank, world, device, "llama", tokens=13),
    "refusals": refusals,
    # Offload under cp (layer 0 on the GPU tier, layer 1 on the host): against one process without offload,
    # and bit for bit against cp without offload; each rank's host slabs hold its own chunks only.
    "llama_offload": lambda rank, world, device: variants(
        rank, world, device, "llama", STREAMED,
        {"cp": STREAMED, "cp_offload": STREAMED.with_options({"offload.enabled": True, "offload.resident_layers": 1})},
        copy_runs=world == 3),
    # Sparse (rerank) under cp: the selections of one process, with and without offload (bit for bit).
    "llama_sparse": lambda rank, world, device: variants(
        rank, world, device, "llama", SPARSE,
        {"cp": SPARSE, "cp_offload": SPARSE.with_options({"offload.enabled": True, "offload.resident_layers": 1})},
        copy_runs=world == 3),
    # Sparse with attention logit softcapping (gemma2): the cap in every rank's share of the keys.
    "gemma2_sparse": lambda rank, world, device: variants(rank, world, device, "gemma2", SPARSE, {"cp": SPARSE}),
    # Other scores and options: minmax leak-free with shared groups of 2 blocks and packed documents;
    # rerank leak-free with offload; the exact score; a budget covering the history (dense attention:
    # against one dense process).
    "sparse_options": lambda rank, world, device: {
        **{f"minmax_{k}": v for k, v in variants(
            rank, world, device, "llama", SPARSE.with_options({"sparse.score": "minmax", "sparse.leak_free": True,
                                                               "sparse.query_block_pages": 2,
                                                               "sparse.research.selection": "shared"}),
            {"cp": SPARSE.with_options({"sparse.score": "minmax", "sparse.leak_free": True,
                                        "sparse.query_block_pages": 2, "sparse.research.selection": "shared",
                                        "offload.enabled": True})}, batch=1, documents=True).items()},
        **{f"rerank_{k}": v for k, v in variants(
            rank, world, device, "llama", SPARSE.with_options({"sparse.leak_free": True}),
            {"cp": SPARSE.with_options({"sparse.leak_free": True, "offload.enabled": True})}, batch=1).items()},
        **{f"exact_{k}": v for k, v in variants(
            rank, world, device, "llama", SPARSE.with_options({"sparse.score": "exact"}),
            {"cp": SPARSE.with_options({"sparse.score": "exact"})}, batch=1).items()},
        **{f"full_{k}": v for k, v in variants(
            rank, world, device, "llama", STREAMED, {"cp": SPARSE.with_options({"sparse.budget": 8})},
            batch=1).items()},
    },
    # The Triton kernels (GPU; interpreted on the CPU is too slow for a 2-process test).
    "llama_batch2_triton": lambda rank, world, device: context_parallel(
        rank, world, device, "llama", config=STREAMED.with_options({"performance.backend": "triton"})),
    # A 2 x 2 grid: tensor parallel inside each context-parallel rank (4 processes).
    "tp2_llama": lambda rank, world, device: context_parallel(rank, world, device, "llama", tp=2),
    # FSDP2 over 2 data-parallel groups of 2 context-parallel ranks, one sequence per group.
    "dp2_llama": lambda rank, world, device: context_parallel(rank, world, device, "llama", dp=2),
}


def run(rank: int, world: int, port: int, out_dir: str, names: list[str], device_type: str = "cpu") -> None:
    """Entry point of torch.multiprocessing.spawn."""
    run_distributed_worker(rank, world, port, out_dir, names,
                           lambda name, device: SCENARIOS[name](rank, world, device), device_type)
