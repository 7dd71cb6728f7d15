"""Per-shard ingest: every input unit is counted and ends up clean or quarantined whole; select reconciles."""

import base64
import csv
import json

import pyarrow.parquet as pq
import pytest

from lmforge.components.data.corpuswork import select
from lmforge.components.data.quarantine import raw_bytes, read_quarantine
from lmforge.components.data.readers import plan_shards, read_shard
from lmforge.components.data.shardwork import ROWS, ingest_shard
from lmforge.components.sections.data import DataConfig

from .corpus import BAD_LINES, write_mixed_jsonl


def ingest_all(cfg: DataConfig, out, **kw):
    return [ingest_shard(spec, cfg, out / f"ingest-{spec['index']}") for spec in plan_shards(cfg, **kw)]


def test_jsonl_shards_count_every_line_and_keep_bad_ones_whole(tmp_path):
    path = write_mixed_jsonl(tmp_path / "m.jsonl", 40)
    path.write_bytes(path.read_bytes() + b"\n\n  \n")  # three blank lines at the end
    n_lines = path.read_bytes().count(b"\n")
    cfg = DataConfig(source=str(path))
    refs = ingest_all(cfg, tmp_path, shard_mb=0.001)
    assert len(refs) > 3  # cut at newlines into several shards
    assert sum(r.records_read for r in refs) == n_lines
    assert sum(r.rows + r.quarantined for r in refs) == n_lines
    sel = select(refs, cfg, tmp_path / "select")
    assert sel.records_read == sel.docs_in == n_lines == sel.clean + sel.quarantined
    assert sel.quarantined_by_reason["blank_line"] == 3
    lines = path.read_bytes().split(b"\n")
    entries = read_quarantine(tmp_path / "select" / "quarantine.jsonl")
    assert sorted(q.reason for q in entries if q.reason != "blank_line") == sorted(r for _, r in BAD_LINES)
    for q in entries:
        assert raw_bytes(q) == lines[q.line - 1] and q.source == "m.jsonl"
    utf8 = next(q for q in entries if q.raw_b64 is not None)  # the line that is not UTF-8
    assert b"\xc3\x28" in base64.b64decode(utf8.raw_b64)


def test_csv_rows_with_extra_or_missing_cells_are_quarantined_not_dropped(tmp_path):
    path = tmp_path / "c.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "text"])
        w.writerow(["a", "A fine document about sockets."])
        w.writerow(["b", "Text with one cell too many.", "surplus"])
        w.writerow(["c"])
        w.writerow(["d", "A second line\nthat spans two lines."])
    cfg = DataConfig(source=str(path))
    (ref,) = ingest_all(cfg, tmp_path)
    assert ref.records_read == 4 == ref.rows + ref.quarantined
    assert ref.quarantined_by_reason == {"column_count": 2}
    entries = read_quarantine(tmp_path / "ingest-0" / "quarantine.jsonl")
    assert [(q.line, raw_bytes(q)) for q in entries] == [(3, b"b,Text with one cell too many.,surplus"), (4, b"c")]
    assert entries[0].meta == {"header": ["id", "text"]}
    assert pq.read_table(tmp_path / "ingest-0" / ROWS).column("id").to_pylist() == ["a", "d"]


def test_unparseable_python_file_is_counted_and_kept_whole(tmp_path):
    (tmp_path / "good.py").write_text('"""A module docstring."""\n\ndef f():\n    """Do f."""\n')
    (tmp_path / "bad.py").write_bytes(b"def broken(:\n    print 'python 2'\n")
    spec = {"kind": "corpus", "index": 0, "files": [["stdlib", str(tmp_path), "bad.py"], ["stdlib", str(tmp_path), "good.py"]]}
    tally: dict = {}
    items = list(read_shard(spec, DataConfig(), tally))
    assert tally["records_read"] == len(items) == 3 and tally["files"] == 2
    ref = ingest_shard(spec, DataConfig(), tmp_path / "out")
    assert ref.rows == 2 and ref.quarantined_by_reason == {"unparseable_file": 1}
    (q,) = read_quarantine(tmp_path / "out" / "quarantine.jsonl")
    assert q.format == "py" and raw_bytes(q) == (tmp_path / "bad.py").read_bytes() and q.source == "stdlib:bad.py"


def test_replayed_entries_are_read_back_through_their_format(tmp_path):
    path = write_mixed_jsonl(tmp_path / "m.jsonl", 40)
    cfg = DataConfig(source=str(path))
    refs = ingest_all(cfg, tmp_path)
    select(refs, cfg, tmp_path / "select")
    entries = read_quarantine(tmp_path / "select" / "quarantine.jsonl")
    fixed = tmp_path / "fixed.jsonl"
    with open(fixed, "w") as f:
        for q in entries:
            d = q.to_dict()
            if q.reason == "invalid_json":
                d["raw"] = json.dumps({"id": "js", "text": "Terminated now."})
            f.write(json.dumps(d) + "\n")
    spec = plan_shards(cfg, replay=[str(fixed)])[-1]
    ref = ingest_shard(spec, cfg, tmp_path / "replay")
    assert ref.records_read == len(entries) == ref.rows + ref.quarantined
    # doc0: a dup id, caught by select
    assert pq.read_table(tmp_path / "replay" / ROWS).column("id").to_pylist() == ["js", "doc0"]
    assert ref.quarantined == len(entries) - 2


@pytest.mark.parametrize("max_docs", [10, 45])
def test_sampling_keeps_exactly_max_docs_records_and_counts_the_rest(tmp_path, max_docs):
    path = write_mixed_jsonl(tmp_path / "m.jsonl", 40)
    cfg = DataConfig(source=str(path), max_docs=max_docs)
    refs = ingest_all(cfg, tmp_path, shard_mb=0.001)
    sel = select(refs, cfg, tmp_path / "select")
    assert sel.docs_in == max_docs == sel.clean + sel.quarantined
    assert sel.records_read == max_docs + sel.sampled_out


def test_feature_event_time_is_the_version_time_not_the_file_time(tmp_path):
    """Two .txt files two years apart: both documents get the corpus version's time, so neither falls out of a ttl."""
    import os

    from lmforge.components.data.corpuswork import assign_split, near_dedup
    from lmforge.components.data.shardwork import finish_records

    src = tmp_path / "txt"
    src.mkdir()
    for name, when in (("old.txt", 1_600_000_000), ("new.txt", 1_663_000_000)):
        (src / name).write_text(f"The {name} document talks about sockets, threads and queues at length.")
        os.utime(src / name, (when, when))
    cfg = DataConfig(source=str(src), split={"validation": 0, "test": 0})
    refs = ingest_all(cfg, tmp_path / "b")
    sel = select(refs, cfg, tmp_path / "b" / "select")
    near = near_dedup(refs, sel, cfg.dedup, tmp_path / "b" / "near")
    spl = assign_split(refs, sel, near, cfg.split, tmp_path / "b" / "split", seed=0)
    (ref,) = [finish_records(r, sel, near, spl, tmp_path / "b" / "fin") for r in refs]
    feats = pq.read_table(tmp_path / "b" / "fin" / "features.parquet").to_pylist()
    assert len(feats) == 2
    assert {f["event_timestamp"].timestamp() for f in feats} == {1_663_000_000.0}
    assert all(f["created_timestamp"] == f["event_timestamp"] for f in feats)


def test_csv_cut_into_many_shards_reads_the_same_rows_as_one(tmp_path):
    """Cuts fall only between rows: quoted newlines, doubled quotes and ragged rows read the same as one shard."""
    import random

    from lmforge.components.data.readers import plan_shards, read_shard

    rng = random.Random(0)
    path = tmp_path / "c.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "text"])
        for i in range(600):
            text = " ".join(rng.choice(["alpha", 'say "hi"', "multi\nline", "x,y", "plain"]) for _ in range(rng.randint(1, 12)))
            w.writerow([f"r{i}", text, *(["surplus"] if i % 97 == 0 else [])])
    cfg = DataConfig(source=str(path))

    def items(shard_mb):
        specs, tally = plan_shards(cfg, shard_mb=shard_mb), {}
        got = [(it.line, it.raw, it.error) for s in specs for it in read_shard(s, cfg, tally)]
        return specs, got, tally["records_read"]

    (one,), whole, n_whole = items(64)
    many, cut, n_cut = items(0.002)
    assert len(many) > 10 and n_cut == n_whole == 600 == len(cut)
    assert cut == whole
    assert sum(e is not None for _, _, e in cut) == 7  # rows 0, 97, ..., 582 have a surplus cell


def test_select_decides_ids_then_texts_in_corpus_order_across_shards(tmp_path):
    """A reused id is quarantined and its text does not count as seen; the first of equal texts is kept."""
    import numpy as np

    docs = [("a", "Text one about sockets and queues."), ("b", "Text one about sockets and queues."),
            ("a", "Text two about threads and locks."), ("c", "Text two about threads and locks."),
            ("b", "Text three about files.")]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs))
    cfg = DataConfig(source=str(path))
    refs = ingest_all(cfg, tmp_path, shard_mb=0.00005)  # about one record a shard
    assert len(refs) >= 4
    sel = select(refs, cfg, tmp_path / "select")
    unique = np.concatenate([np.load(tmp_path / "select" / f"unique-{r.index:05d}.npy") for r in refs])
    exact = np.concatenate([np.load(tmp_path / "select" / f"exact-{r.index:05d}.npy") for r in refs])
    assert unique.tolist() == [True, False, False, True, False]
    assert exact.tolist() == [1, 0]  # the second record collapsed onto the first; none onto the fourth
    assert (sel.clean, sel.exact_duplicates, sel.quarantined) == (3, 1, 2)
    entries = read_quarantine(tmp_path / "select" / "quarantine.jsonl")
    assert [(q.line, q.reason) for q in entries] == [(3, "duplicate_id"), (5, "duplicate_id")]
    assert entries[0].detail == "id 'a' already used by d.jsonl:1" and entries[1].detail == "id 'b' already used by d.jsonl:2"


def test_ingest_cleans_each_text_once_and_derives_each_summary_once(tmp_path, monkeypatch):
    from lmforge.components.data import clean, validate
    from lmforge.components.data.clean import clean_record
    from lmforge.components.data.validate import judge
    from lmforge.components.serving import records

    from .corpus import good_rows

    rows = good_rows(30)
    for r in rows[::2]:
        del r["reference"]  # half derive their summary from the text
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(source=str(path))
    calls = {"clean_text": 0, "first_sentence": 0}

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(clean, "clean_text", counted("clean_text", clean.clean_text))
    for module in (clean, validate, records):
        monkeypatch.setattr(module, "first_sentence", counted("first_sentence", records.first_sentence))
    (ref,) = ingest_all(cfg, tmp_path)
    assert ref.rows == 30 and calls == {"clean_text": 30, "first_sentence": 30}  # one each a record
    got = pq.read_table(ref.path(ROWS), columns=["summary", "text"]).to_pylist()
    monkeypatch.undo()
    items = list(read_shard(plan_shards(cfg)[0], cfg, {}))
    assert got == [{"summary": r.summary, "text": r.text} for r in (clean_record(judge(i, cfg.validation)) for i in items)]
