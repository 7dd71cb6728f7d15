import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.components.data.ingest import RawItem
from lmforge.components.data.quarantine import raw_bytes
from lmforge.components.data.readers import ingest
from lmforge.components.data.validate import REASONS, validate_items, validate_lines
from lmforge.components.sections.data import DataConfig, ValidationConfig

from .corpus import BAD_LINES, good_rows

GOOD = json.dumps({"id": "g", "text": "A good document."}).encode()


@pytest.mark.parametrize("raw, reason", BAD_LINES, ids=[r for _, r in BAD_LINES])
def test_each_bad_kind_is_quarantined_with_its_reason(raw, reason):
    lines = [GOOD, raw] if reason != "duplicate_id" else [json.dumps({"id": "doc0", "text": "first"}).encode(), raw]
    result = validate_lines(lines, ValidationConfig())
    assert [q.reason for q in result.quarantined] == [reason]
    assert result.quarantined[0].origin == "<lines>:2"
    assert result.quarantined[0].detail and raw_bytes(result.quarantined[0]) == raw  # the whole record, byte for byte
    assert len(result.clean) == 1


def test_mixed_corpus_counts_reconcile_and_every_good_record_is_kept(mixed_jsonl):
    path, n_good = mixed_jsonl
    ingested = ingest(DataConfig(source=str(path)))
    result = validate_items(ingested.items, ValidationConfig())
    counts = result.counts()
    assert counts["docs_in"] == counts["clean"] + counts["quarantined"] == n_good + len(BAD_LINES)
    assert sorted(r.record.id for r in result.clean) == sorted(r["id"] for r in good_rows(n_good))
    expected = {}
    for _, reason in BAD_LINES:
        expected[reason] = expected.get(reason, 0) + 1
    assert counts["quarantined_by_reason"] == expected
    assert set(expected) <= set(REASONS)


def test_user_fields_map_onto_the_record():
    line = json.dumps({"id": 7, "text": "Body text. More.", "prompt": "def f(x):", "reference": "Does f.", "module": "m"})
    (kept,) = validate_lines([line.encode()], ValidationConfig()).clean
    r = kept.record
    assert (r.id, r.signature, r.summary, r.text, r.module) == ("7", "def f(x):", "Does f.", "Body text. More.", "m")
    (plain,) = validate_lines([b'{"text": "Just text. Two sentences."}'], ValidationConfig()).clean
    assert plain.record.summary == "Just text." and plain.record.module == plain.record.id


def test_too_long_follows_the_config():
    line = json.dumps({"text": "x" * 100}).encode()
    assert validate_lines([line], ValidationConfig(max_chars=99)).quarantined[0].reason == "too_long"
    assert validate_lines([line], ValidationConfig(max_chars=100)).clean


def test_csv_with_undecodable_bytes_and_missing_text(tmp_path):
    path = tmp_path / "c.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "text"])
        w.writerow(["a", "fine text"])
        w.writerow(["b"])  # a short row: no text column at all
    path.write_bytes(path.read_bytes() + b"c,bad \xff byte\n")
    result = validate_items(ingest(DataConfig(source=str(path))).items, ValidationConfig())
    assert [k.record.id for k in result.clean] == ["a"]
    assert [(q.origin, q.reason) for q in result.quarantined] == [("c.csv:3", "column_count"), ("c.csv:4", "invalid_utf8")]


def test_parquet_binary_column_and_wrong_type(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": pa.array([b"ok text", b"\xc3\x28", b"  "], type=pa.binary())}), path)
    result = validate_items(ingest(DataConfig(source=str(path))).items, ValidationConfig())
    assert len(result.clean) == 1
    assert [q.reason for q in result.quarantined] == ["invalid_utf8", "empty"]
    typed = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": [1.5, 2.5]}), typed)
    result = validate_items(ingest(DataConfig(source=str(typed))).items, ValidationConfig())
    assert [q.reason for q in result.quarantined] == ["wrong_type", "wrong_type"]


def test_folder_of_txt_files(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.txt").write_text("First document.\n")
    (tmp_path / "two.txt").write_bytes(b"caf\xe9")  # latin-1, not UTF-8
    result = validate_items(ingest(DataConfig(source=str(tmp_path))).items, ValidationConfig())
    assert [(k.record.id, k.record.module) for k in result.clean] == [("a/one.txt", "a/one")]
    assert [q.reason for q in result.quarantined] == ["invalid_utf8"]


def test_builtin_docstring_records():
    item = RawItem("stdlib:x.py:f", {"source": "stdlib", "module": "x", "qualname": "f", "signature": "def f():",
                                     "docstring": "Do it. Then more."}, 0.0, kind="docstring")
    empty = RawItem("stdlib:x.py:g", {**item.payload, "qualname": "g", "docstring": ""}, 0.0, kind="docstring")
    result = validate_items([item, empty], ValidationConfig())
    assert result.clean[0].record.summary == "Do it."
    assert result.clean[0].record.text.startswith('def f():\n    """Do it.')
    assert [q.reason for q in result.quarantined] == ["empty"]


def test_parse_json_gives_the_value_or_invalid_json_with_where_it_failed():
    from lmforge.components.data.validate import Bad, parse_json

    assert parse_json('{"a": [1, "x"]}') == {"a": [1, "x"]}
    assert parse_json("[]", "field 'messages': ") == []
    with pytest.raises(Bad) as caught:
        parse_json('{"a": 1', "field 'messages' is not a JSON list: ")
    reason, detail = caught.value.reason, caught.value.detail
    assert reason == "invalid_json"
    assert detail.startswith("field 'messages' is not a JSON list: ") and detail.endswith("at column 8")
