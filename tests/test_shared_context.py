"""shared_context_backward: many continuations of one context, the context computed once.

The references are Hugging Face's own: the loss and gradient of the right-padded batch of rows
context + continuation (the default mean cross-entropy), the sum of the rows' full-sequence backward
passes (a summed loss), and TRL's DPO and GRPO loss formulas on the same log-probabilities.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import build_tiny_model, grads, load_script, lora_model, random_ids, relative_error

import oomb
from oomb import OOMBConfig, SparseConfig
from oomb.config import PerformanceConfig
from oomb.grads import Fp32GradAccumulator
from oomb.shared_context import ContinuationLogProbs, dpo_sigmoid_loss, grpo_loss

TOLERANCE = 1e-5
CHUNK, PAGE = 32, 8
CONTEXT = 2 * CHUNK + 13  # several chunks, ending mid-page (77 tokens: trunk 64, tail 13)
LENGTHS = (1, 5, 2 * CHUNK + 3)  # one token to several chunks
LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]


def _config(**sections) -> OOMBConfig:
    return OOMBConfig(chunk_size=CHUNK, page_size=PAGE, **sections, performance=PerformanceConfig(backend="torch"))


def _inputs(lengths=LENGTHS, context=CONTEXT, seed=0):
    ids = random_ids(1, context + sum(lengths), seed)[0]
    conts, start = [], context
    for n in lengths:
        conts.append(ids[start:start + n])
        start += n
    return ids[:context], conts


def _masked_labels(conts, seed=1):
    """Labels with some positions -100 (the first label of the second continuation among them)."""
    generator = torch.Generator().manual_seed(seed)
    labels = []
    for c in conts:
        drop = torch.rand(c.shape, generator=generator) < 0.3
        labels.append(c.masked_fill(drop, -100))
    labels[1][0] = -100
    return labels


def _rows(context, conts, labels, context_labels):
    ctx_labels = torch.full_like(context, -100) if context_labels is None else context_labels
    ids = [torch.cat([context, c]) for c in conts]
    labs = [torch.cat([ctx_labels, c if lab is None else lab]) for c, lab in zip(conts, labels, strict=True)]
    return ids, labs


def hf_batch_step(model, context, conts, labels=None, context_labels=None, position_ids=None):
    """Hugging Face's loss on the right-padded batch of rows context + continuation, backward run."""
    labels = labels or [None] * len(conts)
    ids, labs = _rows(context, conts, labels, context_labels)
    longest = max(len(x) for x in ids)
    batch = torch.stack([F.pad(x, (0, longest - len(x))) for x in ids])
    batch_labels = torch.stack([F.pad(x, (0, longest - len(x)), value=-100) for x in labs])
    mask = torch.stack([F.pad(torch.ones_like(x), (0, longest - len(x))) for x in ids])
    if position_ids is not None:  # packed documents: HF's padding-free form, one row at a time
        return _hf_documents_step(model, ids, labs, position_ids)
    loss = model(input_ids=batch, attention_mask=mask, labels=batch_labels).loss
    loss.backward()
    return loss.detach()


def _hf_documents_step(model, ids, labs, position_ids):
    """Packed documents: each row alone with its position_ids (HF attends inside documents), the rows' summed
    losses over the batch's counted labels, as the padded batch would weigh them."""
    from oomb.documents import resolve_documents

    counted, sums = 0, []
    for x, lab in zip(ids, labs, strict=True):
        after = position_ids[-1] + 1 + torch.arange(len(x) - len(position_ids))
        positions = torch.cat([position_ids, after])
        docs = resolve_documents(positions, None, (1, len(x)), torch.device("cpu"))
        lab = docs.mask_labels(lab[None])[0]
        logits = model(input_ids=x[None], position_ids=positions[None], use_cache=False).logits[0, :-1].float()
        sums.append(F.cross_entropy(logits, lab[1:], ignore_index=-100, reduction="sum"))
        counted += int((lab[1:] != -100).sum())
    total = sum(sums) / counted
    total.backward()
    return total.detach()


def _step(model, run):
    """(loss, gradients) of ``run`` from zeroed gradients."""
    model.zero_grad(set_to_none=True)
    loss = run()
    return loss, grads(model)


def _compare(model, run, reference):
    want_loss, want = _step(model, reference)
    got_loss, got = _step(model, run)
    assert torch.allclose(got_loss, want_loss, rtol=TOLERANCE, atol=0), (got_loss, want_loss)
    error = relative_error(got, want)
    assert error <= TOLERANCE, error
    return got_loss, got


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_default_loss_equals_hf_on_the_padded_batch(family):
    model = build_tiny_model(family, seed=3)
    context, conts = _inputs()
    labels = _masked_labels(conts)
    _compare(model, lambda: oomb.shared_context_backward(model, context, conts, labels, config=_config()),
             lambda: hf_batch_step(model, context, conts, labels))


def hf_logprobs(model, context, conts, labels=None) -> ContinuationLogProbs:
    """Each continuation's per-token log-probabilities from Hugging Face's logits on its row (with grad)."""
    labels = labels or [None] * len(conts)
    longest = max(len(c) for c in conts)
    tokens, masks = [], []
    for c, lab in zip(conts, labels, strict=True):
        lab = c if lab is None else lab
        logits = model(input_ids=torch.cat([context, c])[None]).logits[0, len(context) - 1:-1].float()
        picked = logits.log_softmax(-1).gather(-1, lab.clamp_min(0)[:, None])[:, 0]
        counted = lab != -100
        tokens.append(F.pad(picked * counted, (0, longest - len(c))))
        masks.append(F.pad(counted, (0, longest - len(c))))
    return ContinuationLogProbs(torch.stack(tokens), torch.stack(masks))


def test_context_labels_count_once_per_continuation_as_in_the_hf_batch():
    model = build_tiny_model("llama", seed=4)
    context, conts = _inputs(lengths=(3, 40))
    context_labels = context.clone()
    context_labels[5:9] = -100
    _compare(model, lambda: oomb.shared_context_backward(model, context, conts, context_labels=context_labels,
                                                         config=_config()),
             lambda: hf_batch_step(model, context, conts, context_labels=context_labels))


@pytest.mark.parametrize("context", [CHUNK - 3, 2 * CHUNK, 2 * CHUNK + 1])
def test_context_lengths_no_trunk_and_chunk_boundaries(context):
    """A context within one chunk (no trunk), ending on a chunk boundary (its tail a whole chunk), or one
    token past it."""
    model = build_tiny_model("qwen3", seed=5)
    ctx, conts = _inputs(lengths=(1, CHUNK + 2), context=context, seed=2)
    _compare(model, lambda: oomb.shared_context_backward(model, ctx, conts, config=_config()),
             lambda: hf_batch_step(model, ctx, conts))


def test_lora_default_loss_equals_hf():
    model = lora_model(build_tiny_model("llama", seed=6), LORA_TARGETS)
    context, conts = _inputs()
    _compare(model, lambda: oomb.shared_context_backward(model, context, conts, config=_config()),
             lambda: hf_batch_step(model, context, conts))


def test_summed_loss_is_the_sum_of_the_rows_full_sequence_backward_passes():
    """loss_fn = the summed negative log-likelihood: the gradient is the sum of each row's HF backward of
    its own summed cross-entropy (each row alone, full sequence)."""
    model = build_tiny_model("llama", seed=8)
    context, conts = _inputs()
    labels = _masked_labels(conts)

    def reference():
        total = 0.0
        for c, lab in zip(conts, labels, strict=True):
            logits = model(input_ids=torch.cat([context, c])[None]).logits[0, len(context) - 1:-1].float()
            loss = F.cross_entropy(logits, lab, ignore_index=-100, reduction="sum")
            loss.backward()
            total = total + loss.detach()
        return total

    _compare(model, lambda: oomb.shared_context_backward(model, context, conts, labels, config=_config(),
                                                         loss_fn=lambda lp: -lp.sums.sum()), reference)


def test_low_precision_gradients_are_summed_in_float32_once_over_the_rows(monkeypatch):
    """bf16 with float32 sums: every row's backward and the trunk's add into one set of float32 sums, written
    into .grad once: not rounded after each row, and no bf16 .grad held beside the sums while later rows run
    (that .grad is the weights' size again: with it the 7B shape's shared step at 128K ran out of memory on an
    80 GB card where one whole sequence fits). The result still follows the float32 step closely."""
    reference_model = build_tiny_model("llama", seed=3)
    model = build_tiny_model("llama", seed=3).to(torch.bfloat16)
    context, conts = _inputs()
    labels = _masked_labels(conts)
    _, want = _step(reference_model, lambda: oomb.shared_context_backward(reference_model, context, conts, labels,
                                                                          config=_config()))
    finished, held = [], []
    finish, collect = Fp32GradAccumulator.finish, Fp32GradAccumulator.collect

    def counting_finish(self):
        finished.append(len(self.params))
        finish(self)

    def watching_collect(self):
        collect(self)
        held.append(sum(p.grad is not None for p in self.params))

    monkeypatch.setattr(Fp32GradAccumulator, "finish", counting_finish)
    monkeypatch.setattr(Fp32GradAccumulator, "collect", watching_collect)
    _, got = _step(model, lambda: oomb.shared_context_backward(model, context, conts, labels, config=_config()))
    assert finished == [len(list(model.parameters()))]  # one accumulator over every bf16 parameter, finished once
    assert len(held) > len(conts) and max(held) == 0  # every chunk's backward collected; no .grad left between
    assert all(g.dtype == torch.bfloat16 for g in got.values())
    assert relative_error(got, want) < 2e-2


def test_logprobs_equal_hf():
    model = build_tiny_model("qwen2", seed=9)
    context, conts = _inputs()
    labels = _masked_labels(conts)
    got = oomb.shared_context_logprobs(model, context, conts, labels, config=_config())
    with torch.no_grad():
        want = hf_logprobs(model, context, conts, labels)
    assert torch.equal(got.mask, want.mask)
    assert torch.allclose(got.tokens, want.tokens, rtol=TOLERANCE, atol=TOLERANCE)


def _trl_dpo_sigmoid(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta):
    """TRL 1.16 trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss, loss_type "sigmoid" with the default
    f_divergence_type "reverse_kl": chosen_scores = chosen_logps - ref_chosen_logps (rejected alike),
    per_sequence_loss = -F.logsigmoid(beta * (chosen_scores - rejected_scores)), loss = per_sequence_loss.mean()."""
    delta_score = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    return (-F.logsigmoid(beta * delta_score)).mean()


def _trl_grpo(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, mask, beta, epsilon_low,
              epsilon_high):
    """TRL 1.16 trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss, loss_type "grpo",
    importance_sampling_level "token", no delta, no masks of entropy or off-policy, one gradient accumulation step."""
    advantages = advantages.unsqueeze(1)
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    per_token_loss = per_token_loss + beta * per_token_kl
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def test_dpo_loss_equals_trl_and_its_gradient_hf():
    """Two preference pairs sharing one context: chosen 0, 1 then rejected 2, 3 (TRL's concatenated order);
    the reference model is the same model with other weights."""
    model, reference_model = build_tiny_model("llama", seed=10), build_tiny_model("llama", seed=11)
    context, conts = _inputs(lengths=(4, 2 * CHUNK + 3, 1, 9))
    reference = oomb.shared_context_logprobs(reference_model, context, conts, config=_config()).sums
    beta = 0.5

    def ours():
        return oomb.shared_context_backward(model, context, conts, config=_config(),
                                            loss_fn=lambda lp: dpo_sigmoid_loss(lp, reference, beta))

    def trl():
        sums = hf_logprobs(model, context, conts).sums
        loss = _trl_dpo_sigmoid(sums[:2], sums[2:], reference[:2], reference[2:], beta)
        loss.backward()
        return loss.detach()

    _compare(model, ours, trl)


def test_grpo_loss_equals_trl_and_its_gradient_hf():
    """A group of completions of one prompt with their advantages, clipping active (old log-probabilities of
    other weights) and a KL term to a reference model."""
    model = lora_model(build_tiny_model("qwen2", seed=12), LORA_TARGETS)
    old_model, reference_model = build_tiny_model("qwen2", seed=13), build_tiny_model("qwen2", seed=14)
    context, conts = _inputs(lengths=(6, 1, CHUNK + 5))
    labels = _masked_labels(conts)
    old = oomb.shared_context_logprobs(old_model, context, conts, labels, config=_config()).tokens
    reference = oomb.shared_context_logprobs(reference_model, context, conts, labels, config=_config()).tokens
    advantages = torch.tensor([1.0, -0.5, -0.5])
    options = dict(beta=0.04, epsilon_low=0.2, epsilon_high=0.28)

    def ours():
        return oomb.shared_context_backward(model, context, conts, labels, config=_config(),
                                            loss_fn=lambda lp: grpo_loss(lp, advantages, old=old, reference=reference,
                                                                         **options))

    def trl():
        lp = hf_logprobs(model, context, conts, labels)
        loss = _trl_grpo(lp.tokens, old, reference, advantages, lp.mask, **options)
        loss.backward()
        return loss.detach()

    _compare(model, ours, trl)


def _bitwise(model, run_a, run_b):
    loss_a, grads_a = _step(model, run_a)
    loss_b, grads_b = _step(model, run_b)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


SPARSE = dict(attention="sparse", sparse=SparseConfig(budget=2, sink_pages=1))
LEAK_FREE = dict(attention="sparse", sparse=SparseConfig(budget=2, sink_pages=1, leak_free=True))


@pytest.mark.parametrize("mode", [{}, SPARSE, LEAK_FREE],
                         ids=["dense", "sparse", "leak-free"])
def test_offload_is_bitwise_equal(mode):
    model = build_tiny_model("llama", seed=15)
    context, conts = _inputs()

    def run(offload: dict):
        config = _config(**mode).with_options({"offload.stream_block_pages": 2, **offload})
        return lambda: oomb.shared_context_backward(model, context, conts, config=config)

    _bitwise(model, run({}), run({"offload.enabled": True, "offload.resident_layers": 1}))


def _row_steps(model, context, conts, config, position_ids=None):
    """forward_backward on each row, gradients weighted as the batch's mean: the sum over rows of
    (row's counted labels / all counted labels) x the row's gradient."""
    counts = [len(c) for c in conts]
    total = sum(counts)
    summed, loss = None, 0.0
    for c, n in zip(conts, counts, strict=True):
        row = torch.cat([context, c])
        labels = torch.cat([torch.full_like(context, -100), c])
        positions = None
        if position_ids is not None:
            positions = torch.cat([position_ids, position_ids[-1] + 1 + torch.arange(len(c))])
        model.zero_grad(set_to_none=True)
        loss = loss + oomb.forward_backward(model, row, labels, config, position_ids=positions) * n / total
        row_grads = {k: v * n / total for k, v in grads(model).items()}
        summed = row_grads if summed is None else {k: summed[k] + row_grads[k] for k in summed}
    model.zero_grad(set_to_none=True)
    for name, param in model.named_parameters():
        param.grad = summed[name].clone()
    return loss


@pytest.mark.parametrize("leak_free", [False, True])
def test_sparse_equals_forward_backward_on_each_row(leak_free):
    """Sparse with a small budget: every row's chunks and selections are those of forward_backward on the row."""
    model = build_tiny_model("llama", seed=16)
    context, conts = _inputs(context=3 * CHUNK + 13)
    config = _config(**(LEAK_FREE if leak_free else SPARSE))
    _compare(model, lambda: oomb.shared_context_backward(model, context, conts, config=config),
             lambda: _row_steps(model, context, conts, config))


def test_sparse_with_every_page_is_dense():
    model = build_tiny_model("llama", seed=17)
    context, conts = _inputs()
    config = _config(attention="sparse", sparse=SparseConfig(budget=64))
    _compare(model, lambda: oomb.shared_context_backward(model, context, conts, config=config),
             lambda: hf_batch_step(model, context, conts))


@pytest.mark.parametrize("given", ["position_ids", "cu_seqlens"])
def test_packed_documents_in_the_context(given):
    """Three documents in the context (boundaries mid-page and at a chunk boundary): attention stays inside
    each, the continuations continue the last one; as HF with position_ids on each row."""
    model = build_tiny_model("llama", seed=18)
    context, conts = _inputs()
    lengths = (19, 2 * CHUNK - 19, CONTEXT - 2 * CHUNK)
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    documents = {"position_ids": position_ids} if given == "position_ids" else {"cu_seqlens": [0, 19, 64, CONTEXT]}
    context_labels = context.clone()
    _compare(model, lambda: oomb.shared_context_backward(model, context, conts, context_labels=context_labels,
                                                         config=_config(), **documents),
             lambda: hf_batch_step(model, context, conts, context_labels=context_labels, position_ids=position_ids))


def test_packed_documents_sparse_offload_bitwise():
    model = build_tiny_model("llama", seed=19)
    context, conts = _inputs()
    position_ids = torch.cat([torch.arange(30), torch.arange(CONTEXT - 30)])

    def run(offload: dict):
        return lambda: oomb.shared_context_backward(model, context, conts, config=_config(**SPARSE).with_options(
            offload), position_ids=position_ids)

    _bitwise(model, run({}), run({"offload.enabled": True, "offload.resident_layers": 1}))


def test_refusals():
    model = build_tiny_model("llama", seed=20)
    context, conts = _inputs(lengths=(3,))
    config = _config()
    with pytest.raises(NotImplementedError, match="one context a call"):
        oomb.shared_context_backward(model, torch.stack([context, context]), conts, config=config)
    with pytest.raises(NotImplementedError, match="one process"):
        oomb.shared_context_backward(model, context, conts, config=config, parallel=object())
    with pytest.raises(ValueError, match="context_labels"):
        oomb.shared_context_backward(model, context, conts, context_labels=context, config=config,
                                     loss_fn=lambda lp: lp.sums.sum())
    with pytest.raises(ValueError, match="non-empty"):
        oomb.shared_context_backward(model, context, [], config=config)
    with pytest.raises(ValueError, match="non-empty"):
        oomb.shared_context_backward(model, context, [context[:0]], config=config)
    with pytest.raises(ValueError, match="no counted label"):
        oomb.shared_context_backward(model, context, conts, [torch.full((3,), -100)], config=config)
    with pytest.raises(ValueError, match="scalar"):
        oomb.shared_context_backward(model, context, conts, config=config, loss_fn=lambda lp: lp.tokens)
    windowed = build_tiny_model("mistral", seed=20, sliding_window=16)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        oomb.shared_context_backward(windowed, context, conts, config=config)


def test_example_script_runs():
    """examples/shared_context_dpo.py: DPO steps on a tiny random model, the first loss log(2) (policy = reference)."""
    example = load_script("examples/shared_context_dpo.py")
    losses = example.main(["--context", "300", "--answer", "20", "--chunk", "128", "--page", "32", "--steps", "2"])
    assert abs(losses[0] - math.log(2)) < 1e-5 and all(math.isfinite(x) for x in losses)
