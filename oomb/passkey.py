"""Passkey retrieval: can the model find a number hidden at a given depth of a long context?

A prompt of ``length`` tokens (all of them, answer included) is

    [BOS] filler[:at] + needle + filler[at:] + question + answer
    needle   " The pass key is 12345. Remember it. 12345 is the pass key. "
    question " What is the pass key? The pass key is"
    answer   " 12345"

with a random 5-digit key (``random.Random(seed)``: the same prompts for the same arguments), the
filler cut from given tokens (held-out text) or the repeated FILLER sentence, repeated as needed, and
the needle after ``at = round(depth * filler length)`` filler tokens (depth 0: at the start, 1: just
before the question).

Judged teacher-forced in one forward pass: retrieved iff the model's greedy prediction at every token
of the answer equals that token. That is exactly "greedy decoding after the question starts with the
answer" (each prediction is made from the true earlier tokens, which greedy decoding produces as long
as every earlier prediction was right), without a generation loop at the length; it is stricter than
finding the key anywhere in a free generation (no preamble, no other spacing), and the answer's
log-probability comes with it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import OOMBConfig
from .evaluate import token_logprobs
from .kv.offload import HostSlabs
from .loss import IGNORE_INDEX

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY_DIGITS = 5


@dataclass(frozen=True)
class PasskeyPrompt:
    length: int
    depth: float
    key: str
    input_ids: list[int]
    needle_start: int
    """Position of the needle's first token."""
    answer_start: int
    """Position of the answer's first token; the answer runs to the end."""

    @property
    def answer_positions(self) -> torch.Tensor:
        return torch.arange(self.answer_start, self.length)


def passkey_prompts(tokenizer, lengths: Sequence[int], depths: Sequence[float], per_point: int, seed: int,
                    filler_ids: Sequence[int] | None = None) -> list[PasskeyPrompt]:
    """``per_point`` prompts per (length, depth), lengths outer, keys drawn in that order from ``seed``.

    Args:
        tokenizer: the model's (transformers) tokenizer.
        lengths: tokens per prompt, answer included.
        depths: where the needle goes, as a fraction of the filler before it, in [0, 1].
        per_point: prompts per (length, depth), each with its own key.
        seed: the keys' random seed.
        filler_ids: the haystack's tokens (repeated as needed); None: the FILLER sentence repeated.
    """
    bad = [d for d in depths if not 0 <= d <= 1]
    if bad:
        raise ValueError(f"passkey depths {bad} must lie in [0, 1] (0: the needle first, 1: just before the question)")
    if per_point < 1:
        raise ValueError(f"passkeys per point={per_point} must be at least 1")

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    filler_ids = list(filler_ids) if filler_ids else encode(FILLER)
    bos = tokenizer.bos_token_id
    prefix = [bos] if bos is not None and tokenizer("a")["input_ids"][:1] == [bos] else []
    question = encode(QUESTION)
    rng = random.Random(seed)
    prompts = []
    for length in lengths:
        for depth in depths:
            for _ in range(per_point):
                key = str(rng.randint(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS - 1))
                needle, answer = encode(NEEDLE.format(key=key)), encode(ANSWER.format(key=key))
                room = length - len(prefix) - len(needle) - len(question) - len(answer)
                if room < 0:
                    raise ValueError(f"passkey length {length} is shorter than the needle, question and answer "
                                     f"({length - room} tokens): ask for a longer one")
                filler = (filler_ids * (room // len(filler_ids) + 1))[:room]
                at = round(depth * room)
                ids = prefix + filler[:at] + needle + filler[at:] + question + answer
                prompts.append(PasskeyPrompt(length, depth, key, ids, len(prefix) + at, length - len(answer)))
    return prompts


def judge_passkey(model: torch.nn.Module, prompt: PasskeyPrompt, config: OOMBConfig | None = None, *,
                  progress: bool = False, host_slabs: HostSlabs | None = None) -> dict:
    """One prompt through stage 1: {"retrieved", "answer_logprob", "predicted"} (the greedy answer tokens)."""
    ids = torch.tensor(prompt.input_ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[prompt.answer_start:] = ids[prompt.answer_start:]  # only the answer goes through the LM head
    scores = token_logprobs(model, ids, labels, config, predict_at=prompt.answer_positions, progress=progress,
                            host_slabs=host_slabs)
    predicted = scores.predictions[0].cpu()
    return {"retrieved": bool(torch.equal(predicted, ids[prompt.answer_start:])),
            "answer_logprob": float(scores.logprobs[0, prompt.answer_start:].sum()),
            "predicted": predicted.tolist()}


def passkey_accuracy(model: torch.nn.Module, prompts: Sequence[PasskeyPrompt], config: OOMBConfig | None = None,
                     *, progress: bool = False, host_slabs: HostSlabs | None = None) -> list[dict]:
    """Per (length, depth), in the prompts' order: {"length", "depth", "retrieved", "count", "accuracy",
    "mean_answer_logprob"}."""
    points: dict[tuple[int, float], list[dict]] = {}
    for prompt in prompts:
        result = judge_passkey(model, prompt, config, progress=progress, host_slabs=host_slabs)
        points.setdefault((prompt.length, prompt.depth), []).append(result)
    return [{"length": length, "depth": depth, "retrieved": sum(r["retrieved"] for r in results),
             "count": len(results), "accuracy": sum(r["retrieved"] for r in results) / len(results),
             "mean_answer_logprob": sum(r["answer_logprob"] for r in results) / len(results)}
            for (length, depth), results in points.items()]
