"""Documents -> tokens -> packed sequences of exactly ``seq_len`` tokens, streamed and resumable.

    files (jsonl, parquet, plain text; folders searched recursively)
      -> units: a jsonl line, a parquet row, or a piece (~1 MiB, cut after a newline) of a text file
      -> text: a field, or chat messages through the tokenizer's chat template
      -> tokens: [BOS if the tokenizer adds one] + text + [EOS at the end of each document, unless
         a chat template ended it with EOS already]
      -> one stream, cut into consecutive sequences; labels = input_ids, with -100 at each
         document's first token if documents must not predict each other

Nothing is held in memory but an index of each file (8 bytes per jsonl line or text piece; parquet
row counts from its metadata), one parquet row group, and the tokens not yet handed out (at most
one sequence plus one unit). The order is a pure function of (seed, epoch): files shuffled, then
jsonl lines, parquet row groups and rows inside them; a text file keeps its order. The position of
the next token, ``DataPosition(epoch, file, unit, skip)``, is all a checkpoint needs to continue
exactly: the unit is read and tokenized again and its first ``skip`` tokens dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import weakref
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..loss import IGNORE_INDEX
from .config import DataSection

logger = logging.getLogger(__name__)

SCAN_BLOCK_BYTES = 16 << 20  # read size when indexing jsonl lines
NEWLINE_SEARCH_BYTES = 64 << 10  # how far past a text piece's nominal end to look for a newline
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zip", ".7z")
PROGRESS_BYTES = 256 << 20  # jsonl data from this size on shows a progress bar while its records are checked


@dataclass(frozen=True)
class DataFile:
    path: Path
    format: str  # "jsonl" | "text" | "parquet"


@dataclass(frozen=True)
class DataPosition:
    """Where the next sequence starts: the ``skip``-th token of unit ``unit`` (in the epoch's order)
    of file ``file`` (in the epoch's file order)."""

    epoch: int = 0
    file: int = 0
    unit: int = 0
    skip: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> DataPosition:
        return cls(**{k: int(values[k]) for k in ("epoch", "file", "unit", "skip")})


@dataclass(frozen=True)
class Sample:
    input_ids: torch.Tensor  # (T,) int64
    labels: torch.Tensor  # (T,) int64, IGNORE_INDEX where no loss is taken
    epoch: int
    documents: int  # documents that start inside this sequence
    document_starts: tuple[int, ...] = ()
    """Positions where a document starts inside the sequence (a sequence may begin inside one)."""

    def cu_seqlens(self) -> list[int]:
        """Document boundaries as oomb.forward_backward's cu_seqlens: [0, ..., len(input_ids)]."""
        return sorted({0, len(self.input_ids), *self.document_starts})


# ---- files ---------------------------------------------------------------------------------------


def embedded_corpus_files() -> list[DataFile]:
    """The default corpus: oomb's own Python source, shipped with the package."""
    root = Path(__file__).resolve().parent.parent  # the oomb package, not only oomb/training/
    return [DataFile(p, "text") for p in sorted(root.rglob("*.py"))]


def resolve_files(options: DataSection) -> list[DataFile]:
    """The data files named by ``options.paths`` (folders expanded), or the embedded corpus."""
    if not options.paths:
        return embedded_corpus_files()
    files: list[DataFile] = []
    for entry in options.paths:
        path = Path(entry).expanduser()
        if path.is_file():
            candidates = [path]
        elif path.is_dir():
            candidates = sorted({p for pattern in options.include for p in path.rglob(pattern)
                                 if p.is_file() and not _hidden(p.relative_to(path))})
            if not candidates:
                raise ValueError(f"data folder {entry!r} has no file matching data.include={options.include}; "
                                 "add patterns (e.g. --set 'data.include=[\"*.txt\"]') or name files directly")
        else:
            raise FileNotFoundError(f"data path {entry!r} does not exist (data.paths={options.paths})")
        files += [DataFile(p, _file_format(p, options.format)) for p in candidates]
    return files


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _file_format(path: Path, forced: str) -> str:
    if forced != "auto":
        return forced
    suffix = path.suffix.lower()
    if suffix in COMPRESSED_SUFFIXES:
        raise ValueError(f"data file {str(path)!r} is compressed ({suffix}); decompress it first "
                         "(oomb streams plain jsonl, text and parquet files)")
    if suffix == ".json":
        raise ValueError(f"data file {str(path)!r}: .json is ambiguous; write one JSON object per line as "
                         ".jsonl, or set data.format=jsonl if it already is JSON lines")
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    return "text"


# ---- units inside a file -------------------------------------------------------------------------


@dataclass
class _Unit:
    text: str | None  # None: nothing here (a blank line)
    starts_document: bool
    ends_document: bool
    templated: bool  # rendered by a chat template, which adds its own special tokens


class _JsonlSource:
    """One unit per line; a line is one document (a text field or chat messages)."""

    shuffleable = True

    def __init__(self, path: Path, render) -> None:
        self.path, self.render = path, render
        self.offsets = _line_offsets(path)  # (lines,) int64 byte offset of each line's start
        self._file = None  # kept open while the stream reads here (an open per document costs on network disks)

    def __len__(self) -> int:
        return self.offsets.numel()

    def read(self, unit: int) -> _Unit:
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115 - closed by close(), or when the source is collected
            self._closer = weakref.finalize(self, self._file.close)
        self._file.seek(int(self.offsets[unit]))
        line = self._file.readline().strip()
        if not line:
            return _Unit(None, True, True, False)
        where = f"{self.path}:{unit + 1}"
        record = _parse_line(line, where)
        text, templated = self.render(record, where)
        return _Unit(text, True, True, templated)

    def close(self) -> None:
        if self._file is not None:
            self._closer()
            self._file = None


class _TextSource:
    """A plain-text file is one document, read in pieces cut after a newline (UTF-8 safe)."""

    shuffleable = False

    def __init__(self, path: Path, piece_bytes: int) -> None:
        self.path = path
        self.bounds = _piece_bounds(path, piece_bytes)  # piece i = bytes [bounds[i], bounds[i + 1])

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def read(self, unit: int) -> _Unit:
        with open(self.path, "rb") as f:
            f.seek(self.bounds[unit])
            data = f.read(self.bounds[unit + 1] - self.bounds[unit])
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:  # replaced, and said once per piece: the run goes on
            text = data.decode("utf-8", errors="replace")
            logger.warning("%s: not UTF-8 from byte %d on: the bytes that do not decode are trained as U+FFFD; "
                           "save the file as UTF-8", self.path, self.bounds[unit] + err.start)
        if len(self) == 1 and not text.strip():  # an empty or blank file holds no document (as a blank jsonl line)
            return _Unit(None, True, True, False)
        return _Unit(text, unit == 0, unit == len(self) - 1, False)

    def close(self) -> None:
        pass


class _ParquetSource:
    """One unit per row; rows are read one row group at a time (only the text/messages columns)."""

    shuffleable = True

    def __init__(self, path: Path, render, columns: tuple[str, str]) -> None:
        try:
            import pyarrow.parquet as pq
        except ImportError as err:  # pragma: no cover - pyarrow is a dependency
            raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from err
        self.path, self.render = path, render
        try:
            self.file = pq.ParquetFile(path)
        except Exception as err:  # pyarrow's ArrowInvalid and OSError name neither the file nor the way out
            raise ValueError(f"{path}: {_not_parquet(err)}") from None
        self.columns = [c for c in columns if c in self.file.schema_arrow.names]
        if not self.columns:
            raise ValueError(f"{path}: {_no_document_column(columns, self.file.schema_arrow.names)}")
        metadata = self.file.metadata
        sizes = torch.tensor([metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)],
                             dtype=torch.long)
        self.group_starts = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])  # (groups + 1,)
        self._group, self._rows = -1, None

    def __len__(self) -> int:
        return int(self.group_starts[-1])

    def order(self, generator: torch.Generator) -> torch.Tensor:
        """Row groups in random order, rows in random order inside each: one group in memory at a time."""
        groups = torch.randperm(self.group_starts.numel() - 1, generator=generator).tolist()
        return torch.cat([self.group_starts[g] + torch.randperm(int(self.group_starts[g + 1] - self.group_starts[g]),
                                                                generator=generator) for g in groups]
                         or [torch.zeros(0, dtype=torch.long)])

    def read(self, unit: int) -> _Unit:
        group = int(torch.searchsorted(self.group_starts, torch.tensor(unit), right=True)) - 1
        if group != self._group:
            self._group, self._rows = group, self.file.read_row_group(group, columns=self.columns).to_pydict()
        row = unit - int(self.group_starts[group])
        record = {c: self._rows[c][row] for c in self.columns if self._rows[c][row] is not None}
        text, templated = self.render(record, f"{self.path} row {unit}")
        return _Unit(text, True, True, templated)

    def close(self) -> None:
        self._group, self._rows = -1, None


def _line_offsets(path: Path) -> torch.Tensor:
    """Byte offset of every line start of a file, found in one streaming pass."""
    parts, position = [torch.zeros(1, dtype=torch.long)], 0
    with open(path, "rb") as f:
        while block := f.read(SCAN_BLOCK_BYTES):
            newlines = (torch.frombuffer(bytearray(block), dtype=torch.uint8) == ord("\n")).nonzero().flatten()
            parts.append(newlines + position + 1)
            position += len(block)
    offsets = torch.cat(parts)
    return offsets[offsets < position]  # a final newline starts no line


def _parse_line(line: bytes, where: str):
    """One jsonl line's JSON value; a ValueError naming ``where`` if it is not JSON in UTF-8."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        message = err.msg.removesuffix(" at")  # json's "Invalid control character at" names no position itself
        raise ValueError(f"{where}: not valid JSON ({message} at column {err.colno})") from err
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not UTF-8 (byte {err.start} of the line): save the file as UTF-8") from None


DATA_FIELD_HINT = "set data.text_field or data.messages_field"
"""The fix a record or table without its document field names (evaluation names its own)."""


def _record_problem(record, options: DataSection, chat_template: bool) -> str | None:
    """Why a jsonl or parquet record cannot be trained on, or None."""
    text_field, messages_field = options.text_field, options.messages_field
    if not isinstance(record, dict):
        return f"expected a JSON object with {text_field!r} or {messages_field!r}, got {type(record).__name__}"
    if text_field in record:
        if not isinstance(record[text_field], str):
            return f"field {text_field!r} must be a string, got {type(record[text_field]).__name__}"
        return None
    if messages_field in record:
        if not chat_template:
            return ("chat messages need a chat template, and this tokenizer has none; use a tokenizer with "
                    "chat_template in tokenizer_config.json, or text records")
        messages = record[messages_field]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            kind = type(messages).__name__ if not isinstance(messages, list) else "a list holding " + next(
                type(m).__name__ for m in messages if not isinstance(m, dict))
            return f"field {messages_field!r} must be a list of {{role, content}} objects, got {kind}"
        return None
    return (f"record has neither {text_field!r} nor {messages_field!r} (keys: {sorted(record)}); "
            + DATA_FIELD_HINT)


def check_records(files: list[DataFile], options: DataSection, tokenizer, shown: int = 5,
                  progress: bool = True) -> None:
    """Parse and check every jsonl record and every parquet file's columns before training, so that a bad
    record is named at the start rather than when the stream reaches it, hours in. Raises a ValueError
    listing the first ``shown`` problems and how many there are. ``progress``: a bar over the jsonl bytes
    from PROGRESS_BYTES of them on (one process of several shows none)."""
    chat_template = getattr(tokenizer, "chat_template", None) is not None
    problems, count = [], 0

    def found(problem: str) -> None:
        nonlocal count
        count += 1
        if len(problems) < shown:
            problems.append(problem)

    jsonl_bytes = sum(f.path.stat().st_size for f in files if f.format == "jsonl")
    with tqdm(total=jsonl_bytes, unit="B", unit_scale=True, desc="checking data records (data.check_records)",
              disable=not progress or jsonl_bytes < PROGRESS_BYTES, leave=False) as bar:
        for data_file in files:
            if data_file.format == "jsonl":
                with open(data_file.path, "rb") as f:
                    for number, line in enumerate(f, start=1):
                        bar.update(len(line))
                        if not line.strip():
                            continue
                        where = f"{data_file.path}:{number}"
                        try:
                            problem = _record_problem(_parse_line(line, where), options, chat_template)
                        except ValueError as err:
                            found(str(err))
                            continue
                        if problem is not None:
                            found(f"{where}: {problem}")
            elif data_file.format == "parquet":
                problem = _parquet_columns_problem(data_file.path, options, chat_template)
                if problem is not None:
                    found(f"{data_file.path}: {problem}")
    if count:
        listed = "\n  ".join(problems)
        more = f" (the first {shown} shown)" if count > shown else ""
        raise ValueError(f"{count} problem{'s' if count > 1 else ''} in the data{more}:\n  {listed}\n"
                         "fix the data, or set data.check_records=false to meet each one when the stream reaches it")


def _not_parquet(err: Exception) -> str:
    return f"not a parquet file ({err}); data.format='auto' reads it by its suffix"


def _no_document_column(columns: tuple[str, str], names: list[str]) -> str:
    return f"no column named {columns[0]!r} or {columns[1]!r} (columns: {names}); " + DATA_FIELD_HINT


def _never(kind) -> bool:
    """A pyarrow type test this pyarrow lacks: no column has that type."""
    return False


def _parquet_columns_problem(path: Path, options: DataSection, chat_template: bool) -> str | None:
    """Why a parquet file's columns cannot be read as documents (text, or chat messages), or None."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as err:  # pyarrow's ArrowInvalid and OSError name neither the file nor the way out
        return _not_parquet(err)
    text_field, messages_field = options.text_field, options.messages_field
    if text_field in schema.names:
        kind = schema.field(text_field).type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or getattr(pa.types, "is_string_view", _never)(kind)):
            return f"column {text_field!r} must hold strings, it holds {schema.field(text_field).type}"
        return None
    if messages_field not in schema.names:
        return _no_document_column((text_field, messages_field), schema.names)
    kind = schema.field(messages_field).type
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list,
             getattr(pa.types, "is_list_view", _never), getattr(pa.types, "is_large_list_view", _never))
    if not any(test(kind) for test in lists):
        return f"column {messages_field!r} must hold lists of {{role, content}}, it holds {kind}"
    if not pa.types.is_struct(kind.value_type):
        return f"column {messages_field!r} must hold lists of {{role, content}} objects, it holds {kind}"
    if not chat_template:
        return "chat messages need a chat template, and this tokenizer has none"
    return None


def _piece_bounds(path: Path, piece_bytes: int) -> list[int]:
    """Cut points about ``piece_bytes`` apart, just after a newline, else at a UTF-8 character start."""
    size = path.stat().st_size
    bounds = [0]
    with open(path, "rb") as f:
        while size - bounds[-1] > piece_bytes:
            target = bounds[-1] + piece_bytes
            f.seek(target)
            window = f.read(NEWLINE_SEARCH_BYTES)
            newline = window.find(b"\n")
            if newline >= 0:
                cut = target + newline + 1
            else:  # no newline nearby: do not split a multi-byte character (continuation bytes are 10xxxxxx)
                cut = target + next((i for i, b in enumerate(window) if b & 0xC0 != 0x80), len(window))
            if cut >= size:
                break
            bounds.append(cut)
    return bounds + [size]


# ---- the packed stream ---------------------------------------------------------------------------


@dataclass
class _Segment:
    epoch: int
    file: int
    unit: int
    tokens: torch.Tensor  # (n,) int64
    starts_document: bool
    offset: int = 0  # tokens already handed out


class PackedSequences:
    """An endless iterator of ``Sample``s of exactly ``options.seq_len`` tokens, epoch after epoch.

    Args:
        files: from ``resolve_files``.
        tokenizer: a transformers tokenizer with an eos token (and a chat template for chat data).
        options: the data section.
        seed: makes the order; the same seed and position give the same sequences.
        position: where to start (from a checkpoint), default the beginning.
    """

    def __init__(self, files: list[DataFile], tokenizer, options: DataSection, seed: int,
                 position: DataPosition | None = None, *, repeats_allowed: bool = True) -> None:
        """``repeats_allowed``: a stream shorter than one sequence repeats itself, with a warning (training);
        False: the caller refuses a wrapped stream itself (held-out evaluation), so no warning."""
        if not files:
            raise ValueError("no data files: set data.paths to jsonl/parquet/text files or folders")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token, which joins documents; set eos_token in its config")
        self.files, self.tokenizer, self.options, self.seed = files, tokenizer, options, seed
        self.eos = tokenizer.eos_token_id
        bos = tokenizer.bos_token_id
        self.bos = bos if bos is not None and tokenizer("a")["input_ids"][:1] == [bos] else None
        self._sources: dict[int, object] = {}
        self._order_key, self._unit_order = None, None
        self._warned_small = not repeats_allowed
        self.epoch_tokens: int | None = None
        """Tokens in one whole epoch of the data, known once an epoch read from its start has ended."""
        self.seek(position or DataPosition())

    # -- position --

    @property
    def position(self) -> DataPosition:
        """Where the next sequence starts."""
        if self._segments:
            s = self._segments[0]
            return DataPosition(s.epoch, s.file, s.unit, s.offset)
        epoch, file, unit = self._cursor
        return DataPosition(epoch, file, unit, self._skip)

    def seek(self, position: DataPosition) -> None:
        if position.file > len(self.files):
            raise ValueError(f"data position {position} points past the {len(self.files)} data files: did "
                             "data.paths change since the checkpoint?")
        self._segments: deque[_Segment] = deque()
        self._available = 0  # tokens in _segments not handed out yet
        self._cursor = (position.epoch, position.file, position.unit)
        self._skip = position.skip
        self._epoch_tokens = 0
        self._epoch_complete = position.file == 0 and position.unit == 0  # this epoch is read from its start

    def close(self) -> None:
        for source in self._sources.values():
            source.close()

    # -- iteration --

    def __iter__(self) -> PackedSequences:
        return self

    def __next__(self) -> Sample:
        seq_len = self.options.seq_len
        while self._available < seq_len:
            self._read_next_unit()
        self._available -= seq_len
        input_ids = torch.empty(seq_len, dtype=torch.long)
        starts = torch.zeros(seq_len, dtype=torch.bool)
        filled, epoch = 0, self._segments[0].epoch
        while filled < seq_len:
            segment = self._segments[0]
            if segment.offset == 0 and segment.starts_document:
                starts[filled] = True
            n = min(len(segment.tokens) - segment.offset, seq_len - filled)
            input_ids[filled:filled + n] = segment.tokens[segment.offset:segment.offset + n]
            segment.offset += n
            filled += n
            if segment.offset == len(segment.tokens):
                self._segments.popleft()
        labels = input_ids.clone()
        if self.options.mask_document_boundaries or self.options.documents == "loss_only":
            # The previous document's last token (EOS) predicts nothing. (documents: separate: the step
            # masks these labels itself, from the boundaries it is given.)
            labels[starts] = IGNORE_INDEX
        return Sample(input_ids, labels, epoch, int(starts.sum()), tuple(starts.nonzero().flatten().tolist()))

    def _read_next_unit(self) -> None:
        epoch, file, unit = self._cursor
        file_order = self._files_for(epoch)
        if file >= len(file_order):  # end of the epoch
            if self._epoch_complete and self._epoch_tokens == 0:
                raise ValueError(f"the data has no tokens: {len(self.files)} file(s), all empty or blank "
                                 f"(first: {self.files[0].path})")
            if self._epoch_complete and self._epoch_tokens < self.options.seq_len and not self._warned_small:
                self._warned_small = True
                logger.warning("the data holds %d tokens per epoch, fewer than data.seq_len=%d: every sequence "
                               "repeats it", self._epoch_tokens, self.options.seq_len)
            if self._epoch_complete:
                self.epoch_tokens = self._epoch_tokens
            self._cursor, self._epoch_tokens, self._epoch_complete = (epoch + 1, 0, 0), 0, True
            logger.info("data: epoch %d done, starting epoch %d", epoch, epoch + 1)
            return
        index = file_order[file]
        source = self._source(index)
        units = self._units_for(epoch, index, source)
        if unit >= len(units):
            source.close()  # drop its file handle / row group; reopened if a later epoch comes back
            self._cursor = (epoch, file + 1, 0)
            return
        self._cursor = (epoch, file, unit + 1)
        piece = source.read(int(units[unit]))
        tokens = self._tokenize(piece)
        skip, self._skip = self._skip, 0
        if len(tokens) > skip:
            self._epoch_tokens += len(tokens)
            self._available += len(tokens) - skip
            self._segments.append(_Segment(epoch, file, unit, tokens, piece.starts_document, skip))

    def _tokenize(self, unit: _Unit) -> torch.Tensor:
        if unit.text is None:
            return torch.zeros(0, dtype=torch.long)
        ids = self.tokenizer.encode(unit.text, add_special_tokens=False, verbose=False)
        if unit.starts_document and self.bos is not None and not unit.templated:
            ids = [self.bos, *ids]
        if unit.ends_document and not (unit.templated and self._ends_with_eos(unit.text)):
            ids.append(self.eos)
        return torch.tensor(ids, dtype=torch.long)

    def _ends_with_eos(self, text: str) -> bool:
        """Whether a chat template already closed the text with EOS (Qwen, SmolLM: ``<|im_end|>\\n``;
        Llama 3: ``<|eot_id|>``): a second EOS would teach the model to repeat it."""
        eos = self.tokenizer.eos_token
        return bool(eos) and text.rstrip().endswith(eos)

    # -- order --

    def _files_for(self, epoch: int) -> list[int]:
        if self.options.shuffle:
            return torch.randperm(len(self.files), generator=_generator(self.seed, epoch, "files")).tolist()
        return list(range(len(self.files)))

    def _units_for(self, epoch: int, index: int, source) -> torch.Tensor:
        key = (epoch, index)
        if self._order_key != key:
            if self.options.shuffle and source.shuffleable:
                generator = _generator(self.seed, epoch, "units", index)
                order = source.order(generator) if hasattr(source, "order") else torch.randperm(
                    len(source), generator=generator)
            else:
                order = torch.arange(len(source))
            self._order_key, self._unit_order = key, order
        return self._unit_order

    def _source(self, index: int):
        if index not in self._sources:
            data_file = self.files[index]
            if data_file.format == "jsonl":
                self._sources[index] = _JsonlSource(data_file.path, self._render)
            elif data_file.format == "parquet":
                self._sources[index] = _ParquetSource(data_file.path, self._render,
                                                      (self.options.text_field, self.options.messages_field))
            else:
                self._sources[index] = _TextSource(data_file.path, self.options.text_piece_bytes)
        return self._sources[index]

    def _render(self, record, where: str) -> tuple[str, bool]:
        """A record's text, or its chat messages rendered by the tokenizer's chat template."""
        problem = _record_problem(record, self.options, getattr(self.tokenizer, "chat_template", None) is not None)
        if problem is not None:
            raise ValueError(f"{where}: {problem}")
        if self.options.text_field in record:
            return record[self.options.text_field], False
        return self.tokenizer.apply_chat_template(record[self.options.messages_field], tokenize=False), True


def _generator(seed: int, *keys) -> torch.Generator:
    """A torch generator seeded from (seed, keys): stable across runs and machines."""
    digest = hashlib.sha256("/".join(map(str, (seed, *keys))).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
