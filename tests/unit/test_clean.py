"""Pure text functions and the chunked reader's ownership rule."""

import gzip

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparklm.config import DataConfig, StorageConfig
from sparklm.data import clean, sources


def test_clean_text_normalises():
    assert clean.clean_text("\ufeff  Hello\r\nworld\r  ") == "Hello\nworld"
    assert clean.clean_text("e\u0301") == "\u00e9"  # NFC composes
    assert clean.clean_text("ﬁ", "NFKC") == "fi"
    assert clean.clean_text("ﬁ", "none") == "ﬁ"


def test_a_lone_surrogate_from_a_json_escape_becomes_the_replacement_character():
    """Found in the sweep: JSON may escape half a UTF-16 pair ("\\ud800"); json.loads keeps it, and the tokenizer
    then failed the write task with a TypeError traceback."""
    assert clean.clean_text("a \ud800 b \udfff") == "a \ufffd b \ufffd"
    assert clean.clean_text("pair \U0001F600 kept") == "pair \U0001F600 kept"
    assert clean.clean_text("\ud83d\ude00", "none") == "\ufffd\ufffd"  # a pair json.loads would have joined


def test_decode_counts_invalid_bytes():
    text, bad = clean.decode(b"ok \xff\xfe then \xc3\xa9 and \xe2\x82", "utf-8")
    assert bad == 4 and text.count("\ufffd") == 3 and "é" in text
    assert clean.decode("ça".encode("latin-1"), "latin-1") == ("ça", 0)


def test_sniff_and_binary():
    assert clean.sniff_encoding("x".encode("utf-16"), "utf-8") == "utf-16"
    assert clean.sniff_encoding(b"\xef\xbb\xbfx", "utf-8") == "utf-8-sig"
    assert clean.looks_binary(b"\x7fELF\x00\x00", "utf-8")
    assert not clean.looks_binary("hé".encode("utf-16"), "utf-16")


def test_group_documents_modes():
    lines = [(0, "a\n"), (2, "b\n"), (4, "\n"), (5, "  \n"), (8, "c\n"), (10, "\n")]
    assert list(clean.group_documents(lines, "paragraph")) == [(0, "a\nb\n"), (8, "c\n")]
    assert list(clean.group_documents(lines, "line")) == [(0, "a\n"), (2, "b\n"), (8, "c\n")]
    assert list(clean.group_documents(lines, "file")) == [(0, "a\nb\n\n  \nc\n\n")]
    assert list(clean.group_documents(lines, "paragraph", stop=8)) == [(0, "a\nb\n")]


def test_split_is_a_pure_function_of_content():
    d = clean.digest("some document")
    assert clean.digest("some document") == d and clean.doc_id(d) == clean.doc_id(clean.digest("some document"))
    docs = [clean.digest(f"doc {i}") for i in range(20000)]
    share = sum(clean.is_validation(x, 0.1) for x in docs) / len(docs)
    assert 0.09 < share < 0.11
    assert not any(clean.is_validation(x, 0.0) for x in docs)


def _read(path, mode, split_mb_bytes, fmt="text"):
    """All documents of a file read in byte ranges of the given size (as the planner would cut it)."""
    size = path.stat().st_size
    data = DataConfig(doc_mode=mode)
    out = []
    for start in range(0, max(size, 1), split_mb_bytes):
        unit = sources.ReadUnit(str(path), fmt, "", start, min(start + split_mb_bytes, size))
        out += [(pos, text) for pos, status, text, _ in sources._read_unit(unit, data, StorageConfig())]
    return out


line = st.text(alphabet=st.sampled_from(list("ab é漢\t ")), max_size=12)
lines = st.lists(st.one_of(line, st.just(""), st.just("  ")), min_size=0, max_size=30)


@settings(max_examples=150, deadline=None)
@given(lines=lines, chunk=st.integers(1, 40), mode=st.sampled_from(["line", "paragraph"]), crlf=st.booleans())
def test_byte_ranges_read_every_document_exactly_once(tmp_path_factory, lines, chunk, mode, crlf):
    path = tmp_path_factory.mktemp("r") / "f.txt"
    path.write_bytes(("\r\n" if crlf else "\n").join(lines).encode())
    whole = _read(path, mode, 10**9)
    assert _read(path, mode, chunk) == whole


def test_jsonl_csv_parquet_and_compressed(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text('{"text": "one"}\nnot json\n{"other": 1}\n{"text": null}\n\n{"text": "two"}\n')
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write('{"body": "gz one"}\n')
    (tmp_path / "c.csv").write_text('id,text\n1,"multi\nline, quoted"\n2\n3,plain\n')
    pq.write_table(pa.table({"text": ["p1", None, "p3"]}), tmp_path / "d.parquet")
    data = DataConfig()

    def read(name, **kw):
        fmt, comp = sources.detect_format(name)
        unit = sources.ReadUnit(str(tmp_path / name), fmt, comp)
        return [(s, t) for _, s, t, _ in sources._read_unit(unit, DataConfig(**kw) if kw else data, StorageConfig())]

    assert read("a.jsonl") == [("ok", "one"), ("malformed", None), ("malformed", None), ("empty", None), ("ok", "two")]
    assert read("b.jsonl.gz", text_field="body") == [("ok", "gz one")]
    assert read("c.csv") == [("ok", "multi\nline, quoted"), ("malformed", None), ("ok", "plain")]
    assert read("d.parquet") == [("ok", "p1"), ("empty", None), ("ok", "p3")]
    with pytest.raises(Exception, match="no column 'body'"):
        read("c.csv", text_field="body")


def test_utf16_and_binary_files(tmp_path):
    (tmp_path / "u16.txt").write_bytes("para one\n\npara two ü\n".encode("utf-16"))
    (tmp_path / "bin.dat").write_bytes(bytes(range(256)) * 10)
    data = DataConfig()
    u16 = list(sources._read_unit(sources.ReadUnit(str(tmp_path / "u16.txt"), "text", ""), data, StorageConfig()))
    assert [t for _, _, t, _ in u16] == ["para one\n", "para two ü\n"]
    binary = list(sources._read_unit(sources.ReadUnit(str(tmp_path / "bin.dat"), "text", ""), data, StorageConfig()))
    assert binary == [(0, "binary_file", None, 0)]


def test_a_five_megabyte_line_is_one_document(tmp_path):
    big = "word " * 1_000_000
    (tmp_path / "big.txt").write_text(f"short\n{big}\nafter\n")
    docs = _read(tmp_path / "big.txt", "line", 1024 * 1024)
    assert [len(t) for _, t in docs] == [6, len(big) + 1, 6]


def _records(path, **kw):
    """(status, text or record) of every record of one file, read whole."""
    fmt, comp = sources.detect_format(path.name)
    unit = sources.ReadUnit(str(path), fmt, comp, size=path.stat().st_size)
    return [(s, t) for _, s, t, _ in sources._read_unit(unit, DataConfig(**kw), StorageConfig())]


def test_a_json_file_that_holds_an_array_of_records_is_read_record_by_record(tmp_path):
    import json

    long = "word " * 600_000  # 3 MB: an element longer than the reader's block
    records = [{"text": "one"}, {"text": 2}, {"other": "x"}, {"text": None}, {"text": 'two ] , [ {"text": "x"}'},
               {"text": long}, {"text": "last"}]
    want = [("ok", "one"), ("malformed", None), ("malformed", None), ("empty", None), ("ok", records[4]["text"]),
            ("ok", long), ("ok", "last")]
    (tmp_path / "pretty.json").write_text(json.dumps(records, indent=2))
    with gzip.open(tmp_path / "compact.json.gz", "wt") as f:
        f.write(" \n" + json.dumps(records))
    (tmp_path / "bom.json").write_bytes("\ufeff[{\"text\": \"één\"}]\n".encode("utf-8"))
    assert _records(tmp_path / "pretty.json") == want
    assert _records(tmp_path / "compact.json.gz") == want
    assert _records(tmp_path / "bom.json") == [("ok", "één")]
    # cut in byte ranges as the planner cuts a large file: the first range reads the whole array, the others nothing
    assert _read(tmp_path / "pretty.json", "line", 1 << 20, fmt="jsonl") == \
        _read(tmp_path / "pretty.json", "line", 10**9, fmt="jsonl")
    assert len(_read(tmp_path / "pretty.json", "line", 1 << 20, fmt="jsonl")) == len(records)
    # instruction records, and an array that is empty
    (tmp_path / "pairs.json").write_text(json.dumps([{"prompt": "p", "response": "r"}]))
    [(status, record)] = _records(tmp_path / "pairs.json", format="instruction")
    assert status == "ok" and record.messages == (("user", "p"), ("assistant", "r"))
    (tmp_path / "none.json").write_text("[ ]")
    assert _records(tmp_path / "none.json") == []


@pytest.mark.parametrize("broken", ['[{"text": "a"}, {"text": "b"', '[{"text": "a"} {"text": "b"}]',
                                    '[{"text": "a"}] [{"text": "b"}]', '[{"text": "a"}, {text: "b"}]'])
def test_a_broken_json_array_is_one_line_that_says_where(tmp_path, broken):
    from sparklm.infra.errors import SparklmError

    (tmp_path / "cut.json").write_text(broken)
    with pytest.raises(SparklmError, match=r"cannot read .*cut\.json: the JSON array breaks at line 1 column \d+"):
        _records(tmp_path / "cut.json")


def test_xz_compressed_text_and_records_are_read(tmp_path):
    import lzma

    with lzma.open(tmp_path / "a.txt.xz", "wt") as f:
        f.write("para one\n\npara two\n")
    with lzma.open(tmp_path / "b.jsonl.xz", "wt") as f:
        f.write('{"text": "x one"}\n{"text": "x two"}\n')
    with lzma.open(tmp_path / "c.csv.xz", "wt") as f:
        f.write("text\ncsv one\n")
    assert _records(tmp_path / "a.txt.xz", doc_mode="paragraph") == [("ok", "para one\n"), ("ok", "para two\n")]
    assert _records(tmp_path / "b.jsonl.xz") == [("ok", "x one"), ("ok", "x two")]
    assert _records(tmp_path / "c.csv.xz") == [("ok", "csv one")]


def test_a_malformed_record_is_named_with_where_it_is_and_why(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"content": "x", "id": 1}\n[1, 2]\nnot json\n'
                                      '{"text": ["a"]}\n{"text": 3}\n')
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write('{"text": "fine"}\n{"body": "y"}\n')
    (tmp_path / "c.json").write_text('[{"text": "fine"},\n {"text": {"a": 1}}]')
    (tmp_path / "d.csv").write_text("id,text\n1,fine\n2\n")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "e.parquet")

    def named(name, **kw):
        data = DataConfig(**kw)
        fmt, comp = sources.detect_format(name)
        unit = sources.ReadUnit(str(tmp_path / name), fmt, comp)
        return [sources.malformed(unit.uri, pos, data, StorageConfig())
                for pos, status, _, _ in sources._read_unit(unit, data, StorageConfig()) if status == "malformed"]

    a = str(tmp_path / "a.jsonl")
    assert named("a.jsonl") == [f"{a} line 2 has no field 'text' (its fields: content, id)",
                                f"{a} line 3 is a JSON array, not an object of fields",
                                f"{a} line 4 is not JSON (Expecting value at column 1)",
                                f"{a} line 5: field 'text' holds a JSON array, not a string",
                                f"{a} line 6: field 'text' holds a JSON number, not a string"]
    assert named("b.jsonl.gz") == [f"{tmp_path / 'b.jsonl.gz'} line 2 has no field 'text' (its fields: body)"]
    assert named("c.json") == [f"{tmp_path / 'c.json'} record 2: field 'text' holds a JSON object, not a string"]
    assert named("d.csv") == [f"{tmp_path / 'd.csv'} row 2 has 1 field, the header 2"]
    assert named("e.parquet") == [f"{tmp_path / 'e.parquet'} row {i}: column 'text' holds int64, not strings"
                                  for i in (1, 2)]


@pytest.mark.parametrize("encoding, told", [("utf-16", ""), ("utf-32", ""), ("utf-16-le", "UTF-16LE"),
                                            ("utf-32-be", "utf_32_be")])
def test_a_utf16_or_utf32_file_cut_in_byte_ranges_is_read_once(tmp_path, encoding, told):
    paragraphs = [f"paragraph {i} ü\nits second line" for i in range(300)]
    path = tmp_path / "wide.txt"
    path.write_bytes("\n\n".join(paragraphs).encode(encoding))
    size = path.stat().st_size
    data = DataConfig(doc_mode="paragraph", encoding=told or "utf-8")  # a BOM says it, or data.encoding must
    docs = []
    for start in range(0, size, 4096):  # as the planner cuts a file larger than data.split_mb
        unit = sources.ReadUnit(str(path), "text", "", start, min(start + 4096, size))
        docs += [t for _, status, t, _ in sources._read_unit(unit, data, StorageConfig())]
    assert [clean.clean_text(t) for t in docs] == paragraphs


def test_a_csv_separated_by_semicolons_is_read_with_its_delimiter_and_named_without_it(tmp_path):
    """Tried as a new user would: a ';'-separated CSV (a spreadsheet's export in much of Europe) was "no column
    'text' (columns: text;label)", with no way to read it."""
    from sparklm.infra.errors import SparklmError

    (tmp_path / "semi.csv").write_text('text;label\n"one; with a semicolon";1\ntwo;0\n')
    assert _records(tmp_path / "semi.csv", csv_delimiter=";") == [("ok", "one; with a semicolon"), ("ok", "two")]
    with pytest.raises(SparklmError, match=r"has no column 'text' \(columns: text;label\)") as e:
        _records(tmp_path / "semi.csv")
    assert "--csv-delimiter ';'" in e.value.hint
    (tmp_path / "t.tsv").write_text("text\tlabel\nthree\t1\n")
    assert _records(tmp_path / "t.tsv") == [("ok", "three")]
    with pytest.raises(SparklmError, match="data.csv_delimiter"):
        DataConfig(csv_delimiter=";;")


def test_a_field_inside_a_field_is_named_with_a_dot_as_spark_names_it(tmp_path):
    """`--text-field meta.body` (Spark's col("meta.body")) read nothing: JSON records, JSON arrays and Parquet structs
    now give the field inside the field; a field whose own name holds the dot is still itself."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from sparklm.infra.errors import SparklmError

    rows = [{"meta": {"body": "one"}}, {"meta": {"body": None}}, {"meta": None}, {"meta": 3}, {"meta": {"x": 1}}]
    want = [("ok", "one"), ("empty", None), ("empty", None), ("malformed", None), ("malformed", None)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "b.json").write_text(json.dumps(rows))
    assert _records(tmp_path / "a.jsonl", text_field="meta.body") == want
    assert _records(tmp_path / "b.json", text_field="meta.body") == want
    pq.write_table(pa.table({"meta": [{"body": "p1", "n": 1}, {"body": None, "n": 2}, None]}), tmp_path / "c.parquet")
    assert _records(tmp_path / "c.parquet", text_field="meta.body") == [("ok", "p1"), ("empty", None), ("empty", None)]
    with pytest.raises(SparklmError, match=r"has no column 'meta.nope' \(columns: meta, meta.body, meta.n\)"):
        _records(tmp_path / "c.parquet", text_field="meta.nope")
    (tmp_path / "d.jsonl").write_text('{"a.b": "literal", "a": {"b": "nested"}}\n')
    pq.write_table(pa.table({"a.b": ["literal"]}), tmp_path / "e.parquet")
    assert _records(tmp_path / "d.jsonl", text_field="a.b") == [("ok", "literal")]
    assert _records(tmp_path / "e.parquet", text_field="a.b") == [("ok", "literal")]
    qa = {"q": {"prompt": "p"}, "a": {"response": "r"}}
    (tmp_path / "f.jsonl").write_text(json.dumps(qa) + "\n")
    pq.write_table(pa.Table.from_pylist([qa]), tmp_path / "g.parquet")
    for name in ("f.jsonl", "g.parquet"):
        [(status, record)] = _records(tmp_path / name, format="instruction", prompt_field="q.prompt",
                                      response_field="a.response")
        assert status == "ok" and record.messages == (("user", "p"), ("assistant", "r")), name
    unit = sources.ReadUnit(str(tmp_path / "a.jsonl"), "jsonl", "")
    data = DataConfig(text_field="meta.body")
    positions = [pos for pos, status, _, _ in sources._read_unit(unit, data, StorageConfig()) if status == "malformed"]
    assert [sources.malformed(unit.uri, p, data, StorageConfig()).split("a.jsonl ")[1] for p in positions] == [
        "line 4 has no field 'meta.body' (its fields: meta)", "line 5 has no field 'meta.body' (its fields: meta)"]


def test_the_files_skipped_as_binary_are_named_with_what_they_may_be():
    from sparklm.launch.prepare import _binary_files

    assert _binary_files(["d/a.pdf", "d/b.txt"]).endswith(": d/a.pdf, d/b.txt; documents such as PDF or Office files "
                                                          "are not read: extract their text first")
    assert _binary_files(["d/a.zip"]).endswith("archives are not read: extract them")
    assert _binary_files([f"d/{i}.txt" for i in range(5)]).startswith(
        "skipped 5 file(s) that look binary (NUL bytes in their first 8 kB): d/0.txt, d/1.txt, d/2.txt and 2 more; "
        "text in UTF-16")
