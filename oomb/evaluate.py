"""Forward only: stage 1 of the step (oomb/engine.py), for evaluating a model the way it trains.

A long sequence runs chunk by chunk over the paged store with the step's attention (dense, or
sparse with the same selection rules), under no_grad, and the final hidden states come back; the
pages are freed at the end. Use it to measure what a model trained with sparse attention does with
sparse attention (e.g. the retrieval accuracy of benchmarks/sparse_accuracy.py).
"""

from __future__ import annotations

import torch

from .config import OOMBConfig
from .engine import _make_store, _validated_inputs, attention_setup, set_history_starts
from .kv import split_into_chunks
from .models import Stage, StepState, layer_checkpointing, oomb_attention, step_window_bounds, unwrap_causal_lm
from .sparse import SparseOptions


@torch.no_grad()
def forward_hidden(model: torch.nn.Module, input_ids: torch.Tensor, config: OOMBConfig | None = None) -> torch.Tensor:
    """The decoder's final hidden states, (B, T, hidden), computed chunk by chunk like stage 1.

    Args:
        model: a supported transformers *ForCausalLM, optionally PEFT-wrapped (set eval() for no dropout).
        input_ids: (B, T) or (T,) token ids.
        config: options (attention mode, chunk and page size, backend); defaults to OOMBConfig().
    Returns:
        (B, T, hidden) in the model's dtype; apply ``model.get_output_embeddings()`` for logits.
    """
    config = config or OOMBConfig()
    causal_lm = unwrap_causal_lm(model)
    device = causal_lm.get_input_embeddings().weight.device
    input_ids, _ = _validated_inputs(causal_lm, input_ids, None, device)
    batch, num_tokens = input_ids.shape
    sparse = SparseOptions.from_config(config)
    backend, _, windows = attention_setup(causal_lm, config, device, num_tokens, None)
    store = _make_store(causal_lm, batch, num_tokens, config, device, sparse)
    chunks = split_into_chunks(num_tokens, config.chunk_size)
    bounds = step_window_bounds(windows, None, (batch, num_tokens), device)
    set_history_starts(store, chunks, windows, bounds, None)
    decoder = causal_lm.get_decoder()
    hidden = []
    try:
        with oomb_attention(causal_lm), layer_checkpointing(decoder, False):
            for chunk in chunks:
                store.allocate(chunk)
                out = decoder(
                    input_ids=input_ids[:, chunk.start:chunk.end],
                    position_ids=torch.arange(chunk.start, chunk.end, device=device).expand(batch, -1),
                    use_cache=False,
                    oomb_step=StepState(store, chunk, Stage.FILL, backend, None, sparse, None, windows, bounds),
                )
                hidden.append(out.last_hidden_state)
    finally:
        store.free_all()
    return torch.cat(hidden, dim=1)
