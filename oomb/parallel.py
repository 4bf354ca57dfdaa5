"""Several GPUs through torch.distributed: tensor parallel (DTensor plans), data parallel (FSDP2) and
context parallel (a sequence's pages spread over ranks, oomb/context_parallel.py).

    mesh (dp, tp)        ranks r = dp_rank * tp + tp_rank; a TP group shares its sequences
    mesh (dp, cp, tp)    with cp > 1: r = (dp_rank * cp + cp_rank) * tp + tp_rank; the cp ranks of a
                         data-parallel group share its sequences and split their pages by chunk
    tensor parallel      per decoder layer: q/k/v, gate/up column-wise, o/down row-wise
                         (parallelize_module); an untied LM head column-wise (vocabulary-sharded), its
                         cross-entropy through loss_parallel: full-vocabulary logits never exist on
                         one rank. Each rank's attention sees Hq/tp query and Hkv/tp KV heads, so its
                         page store holds only those.
    data parallel        fully_shard per decoder layer, over the decoder and over the LM head, with
                         reshard_after_forward=False and reshard_after_backward=False: parameters are
                         all-gathered at the step's first chunk and stay gathered over all chunks;
                         gradient sync is off for every chunk but the last backward of the step, so
                         the chunks' gradients sum in fp32 inside FSDP (reduce_dtype=float32) and are
                         reduce-scattered (averaged over dp) once.
    context parallel     the model stays replicated over cp (TP-sharded inside each cp rank); each
                         attention call merges the cp ranks' partial attentions, so activations and
                         parameter gradients are identical on every cp rank and need no reduction.

Why the engine needs hooks: it runs one backward per chunk (docs/design.md), which FSDP would
otherwise treat as separate steps, and it sizes the page store before any attention call.
``ParallelSetup`` carries the degrees and answers those questions; ``forward_backward(parallel=)``
takes it. Backward correctness of column-parallel layers (the all-reduce of their input gradient)
is DTensor's Replicate -> Partial handling, not a collective written here.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from .context_parallel import ContextShard, check_context_parallel
from .models import unwrap_causal_lm

logger = logging.getLogger(__name__)

MESH_DIMS = ("dp", "tp")
CP_MESH_DIMS = ("dp", "cp", "tp")
"""Mesh dimensions with context parallelism (cp > 1); without it the mesh keeps MESH_DIMS."""


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of parallelism; tp * dp * cp must equal the number of processes."""

    tp: int = 1
    """Tensor-parallel degree: ranks that split every layer's heads and MLP columns."""
    dp: int = 1
    """Data-parallel degree: ranks that train on different sequences (FSDP2 shards weights over them)."""
    cp: int = 1
    """Context-parallel degree: ranks that share one sequence and hold 1/cp of its KV pages each."""

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel {name}={value!r} must be an integer >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.cp


def layer_plan() -> dict[str, object]:
    """Tensor-parallel plan of one decoder layer (names shared by Llama, Mistral, Qwen2/3).

    The attention and MLP inputs become replicated DTensors once per module, so the three (two)
    column-parallel projections add their input gradients before one all-reduce, not three (two).
    """
    return {
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def check_tp_degree(model_config, tp: int) -> None:
    """Refuse a TP degree that does not split the heads evenly (before any process group exists)."""
    heads, kv_heads = model_config.num_attention_heads, model_config.num_key_value_heads
    bad = [f"{name}={value}" for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads))
           if value % tp]
    if bad:
        divisors = [d for d in range(1, kv_heads + 1) if heads % d == 0 and kv_heads % d == 0]
        raise ValueError(f"tensor-parallel degree tp={tp} must divide the model's {' and '.join(bad)}: each rank "
                         f"holds whole heads; valid tp for this model: {divisors}")


@dataclass
class ParallelSetup:
    """What a parallel step and the trainer need: degrees, ranks and the device mesh.

    ``mesh`` is None for a single process; its dimension names are MESH_DIMS (CP_MESH_DIMS with cp > 1).
    """

    config: ParallelConfig = field(default_factory=ParallelConfig)
    mesh: DeviceMesh | None = None
    rank: int = 0
    decoder_root: nn.Module | None = None
    """Data parallel with tied embeddings: the FSDP root the decoder is called through."""

    def decoder_entry(self, decoder: nn.Module) -> nn.Module:
        """The module to call for the decoder's forward (the FSDP root when there is a wrapper)."""
        return self.decoder_root if self.decoder_root is not None else decoder

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def dp(self) -> int:
        return self.config.dp

    @property
    def cp(self) -> int:
        return self.config.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.cp)

    @property
    def cp_rank(self) -> int:
        return self.rank // self.tp % self.cp

    def context_shard(self, chunk_size: int) -> ContextShard | None:
        """This rank's share of the sequence's pages under context parallelism (None: cp == 1)."""
        if self.cp == 1:
            return None
        return ContextShard(self.cp_rank, self.cp, chunk_size, self.mesh.get_group("cp"))

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, prints and writes checkpoints."""
        return self.rank == 0

    def local_kv_heads(self, num_kv_heads: int) -> int:
        """KV heads this rank's attention sees (and its page store holds)."""
        assert num_kv_heads % self.tp == 0, f"num_key_value_heads={num_kv_heads} not divisible by tp={self.tp}"
        return num_kv_heads // self.tp

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Forward and backward of a vocabulary-sharded LM head's cross-entropy must run inside this."""
        return loss_parallel() if self.tp > 1 else contextlib.nullcontext()

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        """Data parallel: reduce gradients in the coming backward (True) or keep summing them locally."""
        for module in _fsdp_modules(model, self.decoder_root):
            module.set_requires_gradient_sync(sync, recurse=False)

    def finish_step(self, model: nn.Module) -> None:
        """Data parallel: release the gathered parameters (an optimizer may change the shards next)."""
        for module in _fsdp_modules(model, self.decoder_root):
            module.reshard()

    @property
    def fsdp(self) -> bool:
        return self.dp > 1

    def barrier(self) -> None:
        """Wait for every rank (e.g. until rank 0 has written a checkpoint)."""
        if self.mesh is not None:
            dist.barrier()

    def all_mean(self, value: float) -> float:
        """Mean of a per-rank number over the data-parallel ranks (for logging a loss)."""
        if self.dp == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.mesh.device_type)
        dist.all_reduce(tensor, group=self.mesh.get_group("dp"))
        return float(tensor) / self.dp


def check_setup(model: nn.Module, parallel: ParallelSetup | None, grad_targets, config=None) -> ParallelSetup:
    """The step's ParallelSetup (a single-process one for None), refusing a parallelized model without it,
    and (given the step's OOMBConfig) the options context parallelism does not support."""
    if parallel is None:
        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise ValueError("the model has DTensor (tensor- or data-parallel) parameters: pass the ParallelSetup "
                             "that oomb.parallel.setup_parallel returned as forward_backward(parallel=...)")
        return ParallelSetup()
    if parallel.fsdp and grad_targets:
        raise ValueError("grad_targets cannot be used with data parallel (FSDP): FSDP sums the chunks' gradients "
                         "in fp32 and leaves them in the sharded parameters' .grad")
    if parallel.cp > 1 and config is not None:
        check_context_parallel(config, unwrap_causal_lm(model))
    return parallel


def _fsdp_modules(model: nn.Module, root: nn.Module | None = None) -> Iterator[nn.Module]:
    """The FSDP units of ``model`` (and ``root``, the DecoderRoot outside the model's tree, if any)."""
    from torch.distributed.fsdp import FSDPModule

    modules = [*model.modules(), *([root] if root is not None else [])]
    return (m for m in modules if isinstance(m, FSDPModule))


def init_distributed(device_type: str) -> int:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...);
    returns the world size (1 without torchrun). NCCL on CUDA, gloo on the CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        return dist.get_world_size() if dist.is_initialized() else 1
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return world


def setup_parallel(model: nn.Module, tp: int = 1, dp: int = 1, *, cp: int = 1,
                   device_type: str | None = None) -> ParallelSetup:
    """Parallelize ``model`` in place: tensor parallel over ``tp`` ranks, then FSDP2 over ``dp``; the
    ``cp`` context-parallel ranks of each (dp, tp) position keep replicas and split the pages.

    Args:
        model: a supported *ForCausalLM (PEFT-wrapped only with tp=1), on this rank's device.
        tp, dp, cp: degrees; tp * dp * cp must be the world size of the initialized process group.
        device_type: "cuda" or "cpu"; default: the device of the model's parameters.
    Returns:
        The ParallelSetup to pass to ``forward_backward(parallel=)`` and the trainer.
    """
    config = ParallelConfig(tp=tp, dp=dp, cp=cp)
    causal_lm = unwrap_causal_lm(model)
    check_tp_degree(causal_lm.config, tp)
    if config.world_size == 1:
        return ParallelSetup(config)
    if tp > 1 and causal_lm is not model:
        raise NotImplementedError("tensor parallel with a PEFT (LoRA) model is not supported; use dp only, "
                                  "or full fine-tuning with tp")
    degrees = f"tp={tp} x dp={dp}" + (f" x cp={cp}" if cp > 1 else "")
    if not dist.is_initialized():
        raise RuntimeError(f"{degrees} needs torch.distributed: start with torchrun --nproc-per-node "
                           f"{config.world_size} (or call init_distributed first)")
    world = dist.get_world_size()
    if world != config.world_size:
        raise ValueError(f"{degrees} = {config.world_size} ranks, but the process group has {world}: "
                         f"start {config.world_size} processes or change tp/dp/cp")
    device_type = device_type or next(model.parameters()).device.type
    if cp > 1:
        mesh = init_device_mesh(device_type, (dp, cp, tp), mesh_dim_names=CP_MESH_DIMS)
        logger.info("context parallel over %d ranks: each holds the pages of every %d-th chunk", cp, cp)
    else:
        mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=MESH_DIMS)
    if tp > 1:
        apply_tensor_parallel(causal_lm, mesh["tp"])
    root = apply_data_parallel(model, causal_lm, mesh["dp"]) if dp > 1 else None
    return ParallelSetup(config, mesh, dist.get_rank(), decoder_root=root)


def apply_tensor_parallel(causal_lm: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard every decoder layer by ``layer_plan`` and the LM head by vocabulary (untied heads only)."""
    decoder = causal_lm.get_decoder()
    for layer in decoder.layers:
        parallelize_module(layer, tp_mesh, layer_plan())
    head, embeddings = causal_lm.get_output_embeddings(), causal_lm.get_input_embeddings()
    if head.weight is embeddings.weight:
        # Sharding a tied head would untie it from the (replicated) embedding.
        logger.warning("tied input/output embeddings: the LM head stays replicated (full logits per slice)")
    else:
        # Vocabulary-sharded logits stay a DTensor for loss_parallel's cross-entropy.
        parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    logger.info("tensor parallel over %d ranks: %d decoder layers and %s", tp_mesh.size(), len(decoder.layers),
                "a replicated LM head" if head.weight is embeddings.weight else "a vocabulary-sharded LM head")


class DecoderRoot(nn.Module):
    """The FSDP root of a model with tied embeddings: the decoder and the LM head under one module,
    whose forward is the decoder's (the engine computes the loss with the head separately)."""

    def __init__(self, decoder: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder
        self.head = head

    def forward(self, *args, **kwargs):
        return self.decoder(*args, **kwargs)


def apply_data_parallel(model: nn.Module, causal_lm: nn.Module, dp_mesh: DeviceMesh) -> nn.Module | None:
    """FSDP2 per decoder layer, over the decoder (the root: the engine calls its forward per chunk)
    and over the LM head, keeping parameters gathered between forward and backward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    decoder, head = causal_lm.get_decoder(), causal_lm.get_output_embeddings()
    # reduce_dtype=float32: gradients summed over chunks without sync are kept in fp32 (FSDP upcasts
    # the unsharded gradient to reduce_dtype when it accumulates), the role Fp32GradAccumulator has
    # on a single GPU.
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in decoder.layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
    root = None
    if head.weight is causal_lm.get_input_embeddings().weight:
        # Tied embeddings: one parameter cannot belong to two FSDP units, and FSDP wants one root
        # module. A wrapper holding the decoder and the head is that root; the engine calls the
        # decoder through it (ParallelSetup.decoder_entry), the head's weight stays gathered with it.
        root = DecoderRoot(decoder, head)
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
    else:
        for module in (decoder, head):
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
    for module in _fsdp_modules(model, root):
        module.set_reshard_after_backward(False, recurse=False)
    logger.info("FSDP2 over %d data-parallel ranks: %d layers, the decoder's own weights, the LM head%s",
                dp_mesh.size(), len(decoder.layers), " (tied: one unit)" if root is not None else "")
    return root


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor (a collective: every rank must call it); plain tensors as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def grad_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of the gradients of a mix of DTensor and plain (replicated) tensors."""
    total = None
    for t in tensors:
        if t.grad is None:
            continue
        norm = full_tensor(t.grad.detach().float().norm()) ** 2  # DTensor: its reduction over the shards
        total = norm if total is None else total + norm.to(total.device)
    return torch.zeros(()) if total is None else total.sqrt()


def clip_grad_norm(tensors: list[torch.Tensor], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` for DTensor and plain gradients together; returns the norm."""
    norm = grad_norm(tensors)
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1:
        for t in tensors:
            if t.grad is not None:
                t.grad.mul_(coef)
    return float(norm)
