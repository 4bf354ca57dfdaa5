"""Chunked LM-head cross-entropy and label shifting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from oomb.loss import IGNORE_INDEX, chunked_cross_entropy, shift_labels

B, L, H, V = 2, 23, 16, 50


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    lm_head = nn.Linear(H, V, bias=True)
    hidden = torch.randn(B, L, H, generator=g)
    targets = torch.randint(0, V, (B, L), generator=g)
    targets[0, 3:9] = IGNORE_INDEX
    targets[:, 10:15] = IGNORE_INDEX  # a 5-token slice with nothing counted when slice_tokens=5
    targets[1, -1] = IGNORE_INDEX
    return lm_head, hidden, targets


def _full_loss(hidden, targets, lm_head, normalizer):
    logits = lm_head(hidden)
    total = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return total / normalizer


@pytest.mark.parametrize("slice_tokens", [1, 5, 7, 23, 1024])
def test_chunked_cross_entropy_matches_full_logits(slice_tokens):
    lm_head, hidden, targets = _setup()
    counted = int((targets != IGNORE_INDEX).sum())
    normalizer = counted + 3  # the caller's normalizer, not the slice's own count

    hidden_ref = hidden.clone().requires_grad_()
    want = _full_loss(hidden_ref, targets, lm_head, normalizer)
    want.backward()
    want_grads = [hidden_ref.grad] + [p.grad.clone() for p in lm_head.parameters()]
    lm_head.zero_grad()

    hidden_got = hidden.clone().requires_grad_()
    got = chunked_cross_entropy(hidden_got, targets, lm_head, normalizer, slice_tokens)
    assert got.dtype == torch.float32 and got.dim() == 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    got.backward()
    got_grads = [hidden_got.grad] + [p.grad for p in lm_head.parameters()]
    for g_got, g_want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-7)
    # Ignored positions get no gradient.
    assert not hidden_got.grad[targets == IGNORE_INDEX].any()

    with torch.no_grad():
        no_grad = chunked_cross_entropy(hidden, targets, lm_head, torch.tensor(normalizer), slice_tokens)
    torch.testing.assert_close(no_grad, want.detach(), rtol=1e-6, atol=0)


def test_matches_mean_cross_entropy_when_normalized_by_the_count():
    lm_head, hidden, targets = _setup(1)
    counted = int((targets != IGNORE_INDEX).sum())
    with torch.no_grad():
        got = chunked_cross_entropy(hidden, targets, lm_head, counted, 4)
        want = F.cross_entropy(lm_head(hidden).reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_all_ignored_gives_a_zero_without_graph():
    lm_head, hidden, targets = _setup()
    hidden.requires_grad_()
    loss = chunked_cross_entropy(hidden, torch.full_like(targets, IGNORE_INDEX), lm_head, 10, 4)
    assert loss.item() == 0.0
    assert not loss.requires_grad


def test_shift_labels():
    labels = torch.tensor([[1, 2, 3, 4], [5, IGNORE_INDEX, 7, 8]])
    want = torch.tensor([[2, 3, 4, IGNORE_INDEX], [IGNORE_INDEX, 7, 8, IGNORE_INDEX]])
    got = shift_labels(labels)
    assert torch.equal(got, want)
    assert got.dtype == labels.dtype
    assert torch.equal(shift_labels(torch.tensor([[9]])), torch.tensor([[IGNORE_INDEX]]))


def test_shift_then_sum_matches_hugging_face_causal_loss():
    """Shifting once and summing per-position losses gives HF's shifted mean cross-entropy."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B, L, V, generator=g)
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[1, 5:12] = IGNORE_INDEX
    targets = shift_labels(labels)
    ours = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    hf = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(ours, hf, rtol=1e-6, atol=0)


def test_slices_with_labels_read_once_with_a_partial_last_slice():
    from oomb.loss import _slices_with_labels

    targets = torch.full((2, 11), IGNORE_INDEX)
    targets[1, 4] = 3  # slice 1 of [0, 4), [4, 8), [8, 11)
    targets[0, 10] = 5  # the partial last slice
    assert _slices_with_labels(targets, 4) == [False, True, True]
    assert _slices_with_labels(torch.full((1, 3), IGNORE_INDEX), 4) == [False]


def _saved_bytes(loss_fn) -> int:
    """Bytes of the tensors autograd saves (each storage once) while ``loss_fn`` runs."""
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn()
    return sum(storages.values())


def test_kept_logits_are_the_log_probabilities_the_planner_counts():
    """Without recompute autograd keeps every slice's fp32 log-probabilities (oomb.activations.
    saved_logits_bytes: tokens x vocabulary x 4 per sequence) besides what the checkpointed slices keep."""
    from oomb.activations import saved_logits_bytes
    from oomb.model_shape import ModelShape

    lm_head, hidden, targets = _setup()
    hidden.requires_grad_(True)
    kept = _saved_bytes(lambda: chunked_cross_entropy(hidden, targets, lm_head, 7, 5, recompute=False))
    recomputed = _saved_bytes(lambda: chunked_cross_entropy(hidden, targets, lm_head, 7, 5, recompute=True))
    shape = ModelShape(num_layers=1, hidden_size=H, intermediate_size=H, num_heads=1, num_kv_heads=1, head_dim=H,
                       vocab_size=V)
    counted = sum(B * 5 for start in range(0, L, 5) if (targets[:, start:start + 5] != IGNORE_INDEX).any())
    assert kept - recomputed >= saved_logits_bytes(shape, counted, 1, False) == counted * V * 4
    assert kept - recomputed <= saved_logits_bytes(shape, B * L, 1, False) * 1.25  # little besides them
    assert saved_logits_bytes(shape, B * L, 1, True) == 0
