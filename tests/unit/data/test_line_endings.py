"""Records are split at `\\n` only: CR, CRLF, U+2028 and a last line without a newline never lose or split a record.

Each input is read whole and cut into many shards; every good record must come out with its
text intact, every bad line must be quarantined whole with its reason, and records in must
equal clean + quarantined.
"""

import csv
import io
import json

import pyarrow.parquet as pq
import pytest

from lmforge.components.data.clean import clean_text
from lmforge.components.data.corpuswork import select
from lmforge.components.data.quarantine import raw_bytes, read_quarantine
from lmforge.components.data.readers import even_target, ingest, plan_shards, read_shard
from lmforge.components.data.shardwork import ROWS, ingest_shard
from lmforge.components.data.validate import judge
from lmforge.components.sections.data import DataConfig

# texts that hold every character str.splitlines() (and bytes.splitlines()) would cut at
ODD = ["carriage\rreturn", "crlf\r\ninside", "line\u2028separator", "para\u2029separator", "tab\there"]


def _good(i: int, text: str) -> dict:
    return {"id": f"g{i}", "text": f"Document {i} about sockets: {text} and queues."}


def _jsonl_corpus() -> tuple[bytes, dict[str, str], dict[int, tuple[bytes, str]]]:
    """(file bytes, {good id: text}, {line number: (raw line, reason)} of the bad lines)."""
    good, bad, lines = {}, {}, []

    def add_good(d: dict, end: bytes = b"\n", ascii_: bool = False) -> None:
        good[d["id"]] = d["text"]
        lines.append(json.dumps(d, ensure_ascii=ascii_).encode() + end)

    def add_bad(raw: bytes, reason: str, end: bytes = b"\n") -> None:
        bad[len(lines) + 1] = (raw, reason)
        lines.append(raw + end)

    for i, text in enumerate(ODD):
        add_good(_good(i, text))                         # escaped \r, raw U+2028/U+2029 (ensure_ascii=False)
        add_good(_good(100 + i, text), end=b"\r\n")      # a CRLF line end
        add_good(_good(200 + i, text), ascii_=True)      # all escaped
    add_bad(b'{"id": "cr", "text": "a raw \r carriage return"}', "invalid_json")   # JSON forbids raw controls
    add_bad(b'{"id": "crlf", "text": "a raw \r\r carriage return"}', "invalid_json", end=b"\r\n")
    add_bad(b'{"id": "vt", "text": "vertical \x0b tab"}', "invalid_json")
    add_bad(b'{"id": "ff", "text": "form \x0c feed"}', "invalid_json")
    add_bad('{"id": "fs", "text": "file \x1c separator"}'.encode(), "invalid_json")
    add_bad('{"id": "nel", "text": "next \x85 line"}'.encode(), "control_chars")  # U+0085 is a C1 control
    add_bad(b"", "blank_line", end=b"\r\n")                                      # a CRLF blank line
    add_bad(b"\r", "blank_line", end=b"\r\n")                                   # a CR, then a CRLF
    add_bad(b'{"id": "half", "text": "cut', "invalid_json", end=b"\r\n")
    add_good(_good(999, "last line, no newline"), end=b"")
    return b"".join(lines), good, bad


@pytest.mark.parametrize("shard_mb", [64, 0.0002])
def test_jsonl_splits_only_at_newlines_and_reconciles(tmp_path, shard_mb):
    data, good, bad = _jsonl_corpus()
    path = tmp_path / "odd.jsonl"
    path.write_bytes(data)
    n_records = data.count(b"\n") + 1  # the last line has no newline
    cfg = DataConfig(source=str(path))

    specs, tally = plan_shards(cfg, shard_mb=shard_mb), {}
    items = [it for s in specs for it in read_shard(s, cfg, tally)]
    assert shard_mb == 64 or len(specs) > 4
    assert tally["records_read"] == len(items) == n_records
    assert [it.line for it in items] == list(range(1, n_records + 1))
    judged = {it.line: judge(it, cfg.validation) for it in items}
    texts = {r.id: r.text for r in judged.values() if not hasattr(r, "reason")}
    assert texts == good  # text equal, character for character, before cleaning
    assert {n: (raw_bytes(q), q.reason) for n, q in judged.items() if hasattr(q, "reason")} == bad

    refs = [ingest_shard(s, cfg, tmp_path / f"ingest-{s['index']}") for s in specs]
    sel = select(refs, cfg, tmp_path / "select")
    assert sel.records_read == sel.docs_in == n_records == sel.clean + sel.quarantined
    assert (sel.clean, sel.quarantined) == (len(good), len(bad))
    rows = [row for r in refs for row in pq.read_table(f"{r.dir}/{ROWS}", columns=["id", "text"]).to_pylist()]
    assert {row["id"]: row["text"] for row in rows} == {i: clean_text(t) for i, t in good.items()}
    entries = read_quarantine(tmp_path / "select" / "quarantine.jsonl")
    assert {q.line: (raw_bytes(q), q.reason) for q in entries} == bad
    assert len(ingest(cfg).items) == n_records  # the all-in-memory reader agrees


def _csv_corpus() -> tuple[bytes, dict[str, str], dict[int, str], list[int]]:
    """(file bytes, {good id: text}, {line: reason} of the bad rows, every row's line), a row's line being the
    line, counted in \\n, where it ends."""
    buf = io.StringIO(newline="")
    good, bad, ends = {}, {}, []

    def row(text: str) -> int:
        buf.write(text)
        ends.append(buf.getvalue().count("\n") + (not text.endswith("\n")))
        return ends[-1]

    csv.writer(buf, lineterminator="\n").writerow(["id", "text"])
    for i, text in enumerate(ODD):
        for j, end in enumerate(("\n", "\r\n")):
            d = _good(10 * i + j, text)
            good[d["id"]] = d["text"]
            row(f'{d["id"]},"{d["text"]}"{end}')  # quoted: a \r or \r\n inside quotes is data
    bad[row('bad1,"one cell too many, with a \r in it",surplus\n')] = "column_count"
    bad[row("bad2,an unquoted \r carriage return\r\n")] = "invalid_csv"  # a row ends at \n only: this is no row
    good["g999"] = "last row, no newline"
    row('g999,"last row, no newline"')
    return buf.getvalue().encode(), good, bad, ends


@pytest.mark.parametrize("shard_mb", [64, 0.00005])
def test_csv_quoted_cr_and_separators_stay_in_their_cell_and_reconcile(tmp_path, shard_mb):
    data, good, bad, ends = _csv_corpus()
    path = tmp_path / "odd.csv"
    path.write_bytes(data)
    cfg = DataConfig(source=str(path))

    specs, tally = plan_shards(cfg, shard_mb=shard_mb), {}
    items = [it for s in specs for it in read_shard(s, cfg, tally)]
    assert shard_mb == 64 or len(specs) > 4
    n_records = len(good) + len(bad)
    assert tally["records_read"] == len(items) == n_records
    assert [it.line for it in items] == ends  # the same however the file is cut, so origins never collide
    judged = [judge(it, cfg.validation) for it in items]
    assert {r.id: r.text for r in judged if not hasattr(r, "reason")} == good
    assert {q.line: q.reason for q in judged if hasattr(q, "reason")} == bad

    refs = [ingest_shard(s, cfg, tmp_path / f"ingest-{s['index']}") for s in specs]
    sel = select(refs, cfg, tmp_path / "select")
    assert sel.records_read == sel.docs_in == n_records == sel.clean + sel.quarantined
    rows = [row for r in refs for row in pq.read_table(f"{r.dir}/{ROWS}", columns=["id", "text"]).to_pylist()]
    assert {row["id"]: row["text"] for row in rows} == {i: clean_text(t) for i, t in good.items()}
    entries = read_quarantine(tmp_path / "select" / "quarantine.jsonl")
    assert {q.line: q.reason for q in entries} == bad
    raws = {q.reason: raw_bytes(q) for q in entries}
    assert raws["invalid_csv"] == b"bad2,an unquoted \r carriage return"  # whole, as read, without its line end
    assert len(ingest(cfg).items) == n_records


def test_quarantined_csv_rows_replay_with_their_carriage_returns(tmp_path):
    """A quarantined CSV row keeps a \\r in a cell quoted, so a fixed copy reads back as the same cells."""
    data, *_ = _csv_corpus()
    path = tmp_path / "odd.csv"
    path.write_bytes(data)
    cfg = DataConfig(source=str(path))
    (spec,) = plan_shards(cfg)
    ingest_shard(spec, cfg, tmp_path / "ingest")
    entries = read_quarantine(tmp_path / "ingest" / "quarantine.jsonl")
    fixed = tmp_path / "fixed.jsonl"
    with open(fixed, "w") as f:
        for q in entries:
            d = q.to_dict()
            if q.reason == "column_count":
                d["raw"] = d["raw"].rsplit(",", 1)[0]  # drop the surplus cell, keep the quoted \r
            f.write(json.dumps(d) + "\n")
    replay = plan_shards(cfg, replay=[str(fixed)])[-1]
    tally: dict = {}
    items = list(read_shard(replay, cfg, tally))
    assert tally["records_read"] == len(items) == 2
    fixed_row, still_bad = (judge(it, cfg.validation) for it in items)
    assert fixed_row.text == "one cell too many, with a \r in it"
    assert still_bad.reason == "invalid_csv" and raw_bytes(still_bad) == b"bad2,an unquoted \r carriage return"


def test_dataset_records_escape_line_separators(tmp_path):
    """records/*.jsonl never holds a raw U+2028/U+2029: a reader that splits with str.splitlines() sees one record a line."""
    from lmforge.components.data.corpuswork import assign_split, near_dedup
    from lmforge.components.data.shardwork import finish_records

    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(_good(i, t), ensure_ascii=False) + "\n" for i, t in enumerate(ODD)), encoding="utf-8")
    cfg = DataConfig(source=str(path), split={"validation": 0, "test": 0})
    refs = [ingest_shard(s, cfg, tmp_path / f"i{s['index']}") for s in plan_shards(cfg)]
    sel = select(refs, cfg, tmp_path / "sel")
    near = near_dedup(refs, sel, cfg.dedup, tmp_path / "near")
    spl = assign_split(refs, sel, near, cfg.split, tmp_path / "split", seed=0)
    (r,) = refs
    finish_records(r, sel, near, spl, tmp_path / "fin")
    text = (tmp_path / "fin" / "records-train.jsonl").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) == len(ODD)
    assert {json.loads(line)["id"]: json.loads(line)["text"] for line in lines} == {
        d["id"]: clean_text(d["text"]) for d in (_good(i, t) for i, t in enumerate(ODD))}


def test_jsonl_shards_weigh_a_huge_line_as_little_as_its_work(tmp_path):
    """A line past JSONL_LINE_CAP x max_chars bytes (quarantined as too_long, never cleaned, hashed or tokenized)
    counts as that many bytes: shards hold about as many documents each, and every line is read once."""
    good = [json.dumps({"id": f"d{i}", "text": f"document {i} " + "word " * 40}).encode() for i in range(400)]
    huge = json.dumps({"id": "huge", "text": "word " * 60_000}).encode()  # 300 kB, validation.max_chars=1000
    lines = good[:100] + [huge] * 2 + good[100:]
    path = tmp_path / "h.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = DataConfig(source=str(path), validation={"max_chars": 1000})
    specs = plan_shards(cfg, shard_mb=0.02)
    data = path.read_bytes()
    per_shard = [data[s["start"]:s["end"]].count(b"\n") for s in specs]
    assert sum(per_shard) == len(lines) and len(specs) % 2 == 0
    assert min(per_shard) >= max(per_shard) / 2, per_shard  # by bytes alone: [87, 14, 1, 86, ...]
    assert [s["first_line"] for s in specs] == [1 + sum(per_shard[:k]) for k in range(len(specs))]
    # with no line over the cap, weight is bytes: a shard ends with the line that holds byte start + target, as before
    plain = tmp_path / "p.jsonl"
    plain.write_bytes(b"\n".join(good) + b"\n")
    data, size = plain.read_bytes(), plain.stat().st_size
    target, ends, start = even_target(size, int(0.005 * 2**20)), [], 0
    while start < size:
        start = min(data.index(b"\n", min(start + target, size - 1)) + 1, size)
        ends.append(start)
    assert [s["end"] for s in plan_shards(DataConfig(source=str(plain)), shard_mb=0.005)] == ends
