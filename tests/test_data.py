"""oomb.training.data: files -> documents -> packed sequences; order, boundaries, streaming pieces, resume."""

from __future__ import annotations

import json

import pytest
import torch

import oomb.training.data
from oomb.loss import IGNORE_INDEX
from oomb.training.config import DataSection
from oomb.training.data import DataPosition, PackedSequences, embedded_corpus_files, resolve_files
from oomb.training.presets import byte_tokenizer

EOS = 256  # the byte tokenizer's <|endoftext|>


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def stream(docs: list[str]) -> list[int]:
    """What the byte tokenizer makes of documents joined with EOS."""
    out = []
    for doc in docs:
        out += [*doc.encode(), EOS]
    return out


def take(sequences, n):
    return [next(sequences) for _ in range(n)]


def options(paths, **kw) -> DataSection:
    return DataSection(paths=[str(p) for p in paths], **{"seq_len": 16, "shuffle": False, **kw})


DOCS = [f"doc {i}: " + "ab" * i for i in range(12)]


def test_jsonl_documents_are_joined_with_eos_and_packed_exactly(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    sequences = PackedSequences(resolve_files(options([path])), tokenizer, options([path]), seed=0)
    expected = stream(DOCS)
    got = take(sequences, len(expected) // 16)
    assert all(s.input_ids.shape == (16,) and s.input_ids.dtype == torch.long for s in got)
    assert torch.cat([s.input_ids for s in got]).tolist() == expected[: 16 * len(got)]
    assert all(torch.equal(s.labels, s.input_ids) for s in got)  # no masking by default


def test_document_boundaries_masked_in_labels_only(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    opts = options([path], mask_document_boundaries=True)
    got = take(PackedSequences(resolve_files(opts), tokenizer, opts, seed=0), 8)
    ids = torch.cat([s.input_ids for s in got])
    labels = torch.cat([s.labels for s in got])
    assert ids.tolist() == stream(DOCS)[: ids.numel()]
    first_tokens = torch.zeros_like(ids, dtype=torch.bool)
    first_tokens[0] = True
    first_tokens[1:] = ids[:-1] == EOS  # a document starts right after an EOS
    assert torch.equal(labels == IGNORE_INDEX, first_tokens)
    assert torch.equal(labels[~first_tokens], ids[~first_tokens])
    assert sum(s.documents for s in got) == int(first_tokens.sum())


def test_chat_messages_rendered_with_the_chat_template(tmp_path, tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}, {"text": "plain"}])
    opts = options([path], seq_len=8)
    ids = torch.cat([s.input_ids for s in take(PackedSequences(resolve_files(opts), tokenizer, opts, 0), 3)])
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert ids.tolist() == stream([rendered, "plain"])[:24]


@pytest.mark.parametrize(
    ("line", "message"),
    [('{"title": "x"}', r"d\.jsonl:2: record has neither 'text' nor 'messages' \(keys: \['title'\]\); set data"),
     ("{oops", r"d\.jsonl:2: not valid JSON"),
     ('{"text": "a\tb"}', r"d\.jsonl:2: not valid JSON \(Invalid control character at column 12\)"),
     ('{"text": 3}', r"field 'text' must be a string, got int")],
)
def test_bad_records_name_file_line_and_fix(tmp_path, tokenizer, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    opts = options([path], seq_len=64)
    with pytest.raises(ValueError, match=message):
        next(PackedSequences(resolve_files(opts), tokenizer, opts, 0))


def test_chat_without_template_is_refused(tmp_path, tokenizer):
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    opts = options([path])
    with pytest.raises(ValueError, match="chat messages need a chat template"):
        next(PackedSequences(resolve_files(opts), tokenizer, opts, 0))


def test_text_files_and_folders(tmp_path, tokenizer):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha\n")
    (folder / "sub" / "b.md").write_text("beta\n")
    (folder / "c.bin").write_bytes(b"\x00\x01")  # not matched by data.include
    (folder / ".hidden").mkdir()
    (folder / ".hidden" / "d.txt").write_text("hidden\n")
    opts = options([folder], seq_len=4)
    files = resolve_files(opts)
    assert [f.path.name for f in files] == ["a.txt", "b.md"] and {f.format for f in files} == {"text"}
    ids = torch.cat([s.input_ids for s in take(PackedSequences(files, tokenizer, opts, 0), 3)])
    assert ids.tolist() == stream(["alpha\n", "beta\n"])[:12]


def test_text_file_read_in_pieces_is_one_document(tmp_path, tokenizer):
    text = "".join(f"line {i} ünïcödé\n" for i in range(40)) + "tail without newline " + "é" * 30
    path = tmp_path / "book.txt"
    path.write_text(text)
    opts = options([path], seq_len=32, text_piece_bytes=50, mask_document_boundaries=True)
    sequences = PackedSequences(resolve_files(opts), tokenizer, opts, 0)
    source = sequences._source(0)
    assert len(source) > 10  # really read in pieces
    expected = stream([text])
    got = take(sequences, len(expected) // 32)
    ids = torch.cat([s.input_ids for s in got])
    assert ids.tolist() == expected[: ids.numel()]  # pieces cut at newlines / character starts: same bytes
    assert int((torch.cat([s.labels for s in got]) == IGNORE_INDEX).sum()) == 1  # one document start


def test_text_piece_without_newline_never_splits_a_character(tmp_path):
    path = tmp_path / "one-line.txt"
    path.write_text("é" * 100)  # 2 bytes each, no newline
    bounds = oomb.training.data._piece_bounds(path, 7)
    data = path.read_bytes()
    assert all(data[b] & 0xC0 != 0x80 for b in bounds[:-1])
    assert bounds[0] == 0 and bounds[-1] == len(data) and bounds == sorted(set(bounds))


def test_jsonl_line_index_across_read_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(oomb.training.data, "SCAN_BLOCK_BYTES", 7)
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    data = path.read_bytes()
    expected = [0] + [i + 1 for i, b in enumerate(data[:-1]) if b == ord("\n")]
    assert oomb.training.data._line_offsets(path).tolist() == expected


def test_parquet_rows_by_row_group(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": DOCS, "other": list(range(len(DOCS)))}), path, row_group_size=5)
    opts = options([path])
    assert resolve_files(opts)[0].format == "parquet"
    ids = torch.cat([s.input_ids for s in take(PackedSequences(resolve_files(opts), tokenizer, opts, 0), 10)])
    assert ids.tolist() == stream(DOCS)[:160]
    shuffled = DataSection(**{**opts.__dict__, "shuffle": True})
    sequences = PackedSequences(resolve_files(shuffled), tokenizer, shuffled, seed=3)
    order = sequences._units_for(0, 0, sequences._source(0)).tolist()
    assert sorted(order) == list(range(len(DOCS)))
    groups = [unit // 5 for unit in order]  # row group of each row, in reading order
    changes = sum(a != b for a, b in zip(groups, groups[1:], strict=False))
    assert changes == 2  # three row groups, each read in one go (rows shuffled inside)


def test_parquet_without_text_column_names_the_columns(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"body": ["x"]}), path)
    opts = options([path])
    with pytest.raises(ValueError, match=r"no column named 'text' or 'messages' \(columns: \['body'\]\)"):
        next(PackedSequences(resolve_files(opts), tokenizer, opts, 0))


def test_order_is_deterministic_for_a_seed_and_covers_every_document(tmp_path, tokenizer):
    paths = [write_jsonl(tmp_path / f"{k}.jsonl", [{"text": f"{k}{i}|"} for i in range(20)]) for k in "abc"]
    opts = options(paths, shuffle=True, seq_len=45)  # 60 documents of 4-5 tokens: 270 = 6 x 45

    def first_epoch(seed):
        sequences = PackedSequences(resolve_files(opts), tokenizer, opts, seed)
        ids = torch.cat([s.input_ids for s in take(sequences, 6)])
        return bytes(t for t in ids.tolist() if t != EOS).decode()

    a, b, c = first_epoch(0), first_epoch(0), first_epoch(1)
    assert a == b and a != c
    assert sorted(a.split("|")[:-1]) == sorted(f"{k}{i}" for k in "abc" for i in range(20))


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_from_a_position_gives_the_same_sequences(tmp_path, tokenizer, shuffle):
    text = tmp_path / "book.txt"
    text.write_text("".join(f"line {i}\n" for i in range(60)))
    jsonl = write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    opts = options([text, jsonl], shuffle=shuffle, seq_len=24, text_piece_bytes=40, mask_document_boundaries=True)
    files = resolve_files(opts)
    reference = PackedSequences(files, tokenizer, opts, seed=5)
    samples, positions = [], []
    for _ in range(80):  # several epochs
        positions.append(reference.position)
        samples.append(next(reference))
    assert samples[-1].epoch >= 2
    for k in (1, 7, 33, 61):
        resumed = PackedSequences(files, tokenizer, opts, seed=5,
                                  position=DataPosition.from_dict(json.loads(json.dumps(positions[k].to_dict()))))
        for want in samples[k:k + 12]:
            got = next(resumed)
            assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.labels, want.labels)


def test_empty_data_is_refused(tmp_path, tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    opts = options([empty])
    with pytest.raises(ValueError, match=r"the data has no tokens: 1 file\(s\), all empty"):
        next(PackedSequences(resolve_files(opts), tokenizer, opts, 0))


def test_missing_paths_and_empty_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="data path .*nope.* does not exist"):
        resolve_files(options([tmp_path / "nope"]))
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match=r"has no file matching data.include"):
        resolve_files(options([tmp_path / "dir"]))


@pytest.mark.parametrize(("name", "message"), [("d.json", r"\.json is ambiguous.*data.format=jsonl"),
                                               ("d.jsonl.gz", r"is compressed \(\.gz\); decompress it first")])
def test_formats_that_cannot_stream_are_refused(tmp_path, name, message):
    (tmp_path / name).write_bytes(b"[]")
    with pytest.raises(ValueError, match=message):
        resolve_files(options([tmp_path / name]))


def test_embedded_corpus_is_the_package_source(tokenizer):
    files = resolve_files(DataSection())
    assert files == embedded_corpus_files() and any(f.path.name == "engine.py" for f in files)
    sample = next(PackedSequences(files, tokenizer, DataSection(seq_len=512), seed=0))
    assert sample.input_ids.max() <= EOS


def test_check_records_names_every_bad_record_before_training(tmp_path, tokenizer):
    good = write_jsonl(tmp_path / "a.jsonl", [{"text": "fine"}] * 3)
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "fine"}\n\n{oops\n{"title": "x"}\n' + '{"text": 3}\n' * 6)
    only_good = options([good])
    oomb.training.data.check_records(resolve_files(only_good), only_good, tokenizer)  # passes: nothing raised
    opts = options([good, bad])
    with pytest.raises(ValueError) as err:
        oomb.training.data.check_records(resolve_files(opts), opts, tokenizer, shown=2)
    lines = str(err.value).splitlines()
    assert lines[0] == "8 problems in the data (the first 2 shown):"
    assert lines[1].endswith("b.jsonl:3: not valid JSON (Expecting property name enclosed in double quotes at "
                             "column 2)")
    assert lines[2].endswith("b.jsonl:4: record has neither 'text' nor 'messages' (keys: ['title']); set "
                             "data.text_field or data.messages_field")
    assert "data.check_records=false" in lines[3]


def test_check_records_refuses_chat_without_template_and_wrong_parquet_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), table)
    opts = options([chat, table])
    with pytest.raises(ValueError, match=r"(?s)2 problems in the data.*c\.jsonl:1: chat messages need a chat template.*"
                                         r"t\.parquet: column 'text' must hold strings, it holds int64"):
        oomb.training.data.check_records(resolve_files(opts), opts, tokenizer)


def test_check_records_shows_progress_on_large_data(tmp_path, tokenizer, monkeypatch, capsys):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "fine"}] * 50)
    opts = options([path])
    oomb.training.data.check_records(resolve_files(opts), opts, tokenizer)
    assert "checking data records" not in capsys.readouterr().err  # small data: no bar
    monkeypatch.setattr(oomb.training.data, "PROGRESS_BYTES", 1)
    oomb.training.data.check_records(resolve_files(opts), opts, tokenizer)
    assert "checking data records (data.check_records)" in capsys.readouterr().err


def test_check_records_takes_every_arrow_string_and_list_type(tmp_path, tokenizer):
    """Polars and datasets write large_list, dictionary and view types: the stream reads them, so the check must."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    messages = [[{"role": "user", "content": "hi"}]]
    tables = {
        "dict.parquet": pa.table({"text": pa.array(["a", "b"]).dictionary_encode()}),
        "large.parquet": pa.table({"text": pa.array(["a"], type=pa.large_string())}),
        "large_list.parquet": pa.table({"messages": pa.array(messages, type=pa.large_list(pa.struct(
            [("role", pa.string()), ("content", pa.string())])))}),
    }
    for name, table in tables.items():
        pq.write_table(table, tmp_path / name)
    opts = options([tmp_path / name for name in tables])
    oomb.training.data.check_records(resolve_files(opts), opts, tokenizer)  # passes: nothing raised
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(pa.table({"messages": pa.array([["hi"]])}), bad / "strings.parquet")
    pq.write_table(pa.table({"title": pa.array(["x"])}), bad / "neither.parquet")
    write_jsonl(bad / "items.jsonl", [{"messages": [{"role": "user", "content": "x"}, "oops"]}])
    opts = options([bad])
    with pytest.raises(ValueError) as err:
        oomb.training.data.check_records(resolve_files(opts), opts, tokenizer)
    text = str(err.value)
    assert text.startswith("3 problems in the data:")
    assert "items.jsonl:1: field 'messages' must be a list of {role, content} objects, got a list holding str" in text
    assert "neither.parquet: no column named 'text' or 'messages' (columns: ['title'])" in text
    assert "strings.parquet: column 'messages' must hold lists of {role, content} objects, it holds list<" in text
