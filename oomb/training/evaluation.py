"""Held-out evaluation at the training length: what `oomb eval` and the trainer's ``eval`` section run.

    data    a text or jsonl file -> documents joined with EOS, in file order (data.py, documents
            "joined") -> its first ``sequences`` sequences of ``seq_len`` tokens
    score   oomb.evaluate.token_logprobs per sequence: stage 1 with the run's oomb options
    report  perplexity by position bucket (oomb/perplexity.py) and passkey accuracy per (length, depth)
            (oomb/passkey.py, the filler cut from the same text), as a JSON-able dict and as a table
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..config import OOMBConfig
from ..evaluate import token_logprobs
from ..kv.offload import HostSlabs
from ..passkey import passkey_accuracy, passkey_prompts
from ..perplexity import PerplexityByPosition
from ..units import format_tokens
from .config import DataSection, EvalSection
from .data import DATA_FIELD_HINT, PackedSequences, resolve_files

logger = logging.getLogger(__name__)


def held_out_sequences(path: str, tokenizer, seq_len: int, count: int, text_field: str = "text") -> list[torch.Tensor]:
    """The first ``count`` sequences of ``seq_len`` tokens of a text or jsonl file (``text_field`` per
    line), documents joined with the tokenizer's EOS; refuses a file that holds fewer tokens."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"eval data {path!r} is not a file: give a text file or a jsonl file with a "
                                f"{text_field!r} field per line")
    options = DataSection(paths=[path], seq_len=seq_len, documents="joined", shuffle=False, text_field=text_field)
    try:
        return _first_sequences(PackedSequences(resolve_files(options), tokenizer, options, seed=0,
                                                repeats_allowed=False), path, seq_len, count)
    except ValueError as err:
        if DATA_FIELD_HINT not in str(err):
            raise
        # the data section's fix names data.*, which evaluation does not read
        raise ValueError(str(err).replace(DATA_FIELD_HINT, EVAL_FIELD_HINT)) from None


EVAL_FIELD_HINT = "set eval.text_field (oomb eval --text-field) to the field holding each document"


def _first_sequences(stream: PackedSequences, path: str, seq_len: int, count: int) -> list[torch.Tensor]:
    sequences = []
    try:
        for _ in range(count):
            sequences.append(next(stream).input_ids)
            if stream.position.epoch > 0:  # the stream wrapped around: the file is shorter than asked
                held = f"{stream.epoch_tokens:,} tokens, " if stream.epoch_tokens is not None else ""
                raise ValueError(
                    f"eval data {path!r} holds {held}{len(sequences) - 1} whole sequence(s) of {seq_len} tokens, "
                    f"fewer than the {count} asked ({count * seq_len:,} tokens): give a longer file, fewer sequences "
                    "or a shorter sequence length")
    finally:
        stream.close()
    return sequences


def run_evaluation(model: torch.nn.Module, tokenizer, options: EvalSection, config: OOMBConfig | None = None, *,
                   seq_len: int | None = None, text_field: str = "text", progress: bool = False,
                   host_slabs: HostSlabs | None = None) -> dict:
    """Perplexity by position over ``options.data`` and passkey accuracy, as a JSON-able dict.

    Args:
        model: a supported *ForCausalLM (PEFT-wrapped too); evaluated in eval mode, its modes restored.
        tokenizer: the model's tokenizer.
        options: what to evaluate (data, sequences, passkey lengths, depths, prompts per point, seed).
        config: the stage-1 options (attention mode, offload, chunk and page size); default dense.
        seq_len: the sequence length when ``options.seq_len`` is empty (the trainer's data.seq_len).
        text_field: the jsonl field of each document when ``options.text_field`` is empty (the trainer's
            data.text_field).
        progress: a progress bar over each sequence's chunks.
        host_slabs: with offload, pinned host memory to reuse (the trainer's).
    Returns:
        {"seq_len", "sequences", "perplexity": [per bucket], "passkey": [per (length, depth)], "seconds"};
        a part not asked for is absent.
    """
    seq_len = options.seq_len or seq_len
    start = time.perf_counter()
    report: dict = {}
    filler = None
    if options.data is not None:
        if seq_len is None:
            raise ValueError("evaluating eval.data needs a sequence length: set eval.seq_len (--seq-len)")
        sequences = held_out_sequences(options.data, tokenizer, seq_len, options.sequences,
                                       options.text_field or text_field)
        totals = PerplexityByPosition(seq_len)
        for index, ids in enumerate(sequences):
            totals.add(token_logprobs(model, ids, config=config, progress=progress, host_slabs=host_slabs).logprobs)
            logger.info("eval: sequence %d of %d scored", index + 1, len(sequences))
        report.update(seq_len=seq_len, sequences=len(sequences), perplexity=totals.results())
        filler = torch.cat(sequences).tolist()
    if options.passkey_lengths:
        prompts = passkey_prompts(tokenizer, options.passkey_lengths, options.passkey_depths,
                                  options.passkeys_per_point, options.seed, filler)
        report["passkey"] = passkey_accuracy(model, prompts, config, progress=progress, host_slabs=host_slabs)
    report["seconds"] = time.perf_counter() - start
    return report


def format_evaluation(report: dict) -> str:
    """The report as two tables: bucket -> tokens, mean NLL, perplexity; passkey length x depth -> accuracy."""
    lines = []
    if "perplexity" in report:
        lines.append(f"perplexity by position ({report['sequences']} sequence(s) of "
                     f"{format_tokens(report['seq_len'])} tokens):")
        lines.append(f"  {'bucket':<12} {'tokens':>12} {'mean NLL':>10} {'perplexity':>12}")
        for b in report["perplexity"]:
            lines.append(f"  {b['bucket']:<12} {b['tokens']:>12,} {b['mean_nll']:>10.4f} {b['perplexity']:>12.3f}")
    if "passkey" in report:
        depths = sorted({p["depth"] for p in report["passkey"]})
        cells = {(p["length"], p["depth"]): p for p in report["passkey"]}
        lines.append("passkey retrieval (accuracy, retrieved / prompts; rows: length, columns: depth):")
        lines.append(f"  {'length':<8}" + "".join(f" {f'depth {d:g}':>16}" for d in depths))
        for length in dict.fromkeys(p["length"] for p in report["passkey"]):
            row = [_accuracy_cell(cells.get((length, d))) for d in depths]
            lines.append(f"  {format_tokens(length):<8}" + "".join(f" {cell:>16}" for cell in row))
    return "\n".join(lines)


def _accuracy_cell(point: dict | None) -> str:
    return "" if point is None else f"{point['accuracy']:.2f} ({point['retrieved']}/{point['count']})"
