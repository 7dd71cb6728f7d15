"""Input shards: cut a source into pieces that can be read independently, and read one piece.

    ingested = ingest(cfg)                         # every item at once, for tests and tools on small inputs
    specs = plan_shards(cfg, shard_mb=8)          # list of small dicts, one per input shard
    tally = {}
    for item in read_shard(specs[0], cfg, tally):  # RawItems, every input unit one item
        ...
    tally["records_read"]                          # counted from the input itself, not from the items

Every input unit becomes exactly one RawItem, good or bad: each JSONL line (a blank one
too: it is judged `blank_line`), each CSV row (a row with more or fewer cells than the
header is judged `column_count`, a row with a \\r outside quotes `invalid_csv`), each Parquet
row, each .txt file, each docstring of the
built-in corpus and each .py file of it that cannot be parsed (`unparseable_file`). The
`records_read` tally is counted from the input (newlines in the byte range, rows in the
row groups, files in the list, CSV rows as the csv module parses them) so that
`records in = clean + quarantined` can be checked.

Records end at "\\n" only (a "\\r" just before it is dropped): a bare "\\r", U+2028 or any other
character that str.splitlines() cuts at stays inside its record, so that the count of newlines
the plan makes and the records the reader yields always agree.

JSONL is cut at newlines into byte ranges of about `shard_mb`, a line weighing its bytes up to
JSONL_LINE_CAP x validation.max_chars (80 kB by default): a line longer than that is all but
surely quarantined as too_long, which costs reading it, not cleaning, hashing and tokenizing
it, so ten 3 MB lines no longer leave a shard with a fifth of the documents of the others (with
no line over the cap, the cuts are where pure byte ranges put them). CSV likewise, by bytes, but only at a
newline outside quotes (an even number of `"` before it: a quoted cell may hold a newline,
and RFC 4180 doubles a quote inside one); Parquet by row groups; .txt folders and the
built-in corpus by files. The shard size is evened out so that the number of shards is
even: with 2 (4, 8, ...) workers the last round is not one shard running alone while the
other cores wait.
"""

from __future__ import annotations

import csv
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.components.data.ingest import (
    JSONL_SUFFIXES,
    SUPPORTED,
    Progress,
    RawItem,
    check_source,
    corpus_files,
    corpus_roots,
    extract_file,
)
from lmforge.components.data.quarantine import (
    CR_OUTSIDE_QUOTES,
    csv_row_bytes,
    fields_bytes,
    iter_quarantine,
    raw_bytes,
    replay_fields,
)
from lmforge.components.errors import UserError
from lmforge.components.sections.data import DataConfig

JSONL_LINE_CAP = 4  # a JSONL line weighs at most this many bytes per validation.max_chars character


def plan_shards(cfg: DataConfig, *, shard_mb: float | None = None, replay: list[str] | None = None) -> list[dict[str, Any]]:
    """The input shards of the configured source (and of quarantine files to replay), in corpus order."""
    target = int((shard_mb or cfg.shard_mb) * 2**20)
    path = check_source(cfg.source)
    if path is None:
        files = [("corpus", s, str(root), rel) for s, root, rel in corpus_files(cfg.include_site_packages, cfg.skip_tests)]
        specs = _plan_files(files, target)
    elif path.is_dir():
        files = [("txt", "", str(path), p.relative_to(path).as_posix()) for p in sorted(path.rglob("*.txt"))]
        specs = _plan_files(files, target)
    elif path.suffix.lower() in JSONL_SUFFIXES:
        specs = _plan_jsonl(path, target, cap=JSONL_LINE_CAP * cfg.validation.max_chars)
    elif path.suffix.lower() == ".parquet":
        specs = _plan_parquet(path, target)
    else:
        specs = _plan_csv(path, even_target(path.stat().st_size, target))
    specs += [{"kind": "replay", "path": str(Path(p).resolve())} for p in (replay or [])]
    return [{**s, "index": i} for i, s in enumerate(specs)]


def even_target(total: int, target: int) -> int:
    """A shard size near `target` (never above it) that cuts `total` bytes into an even number of shards."""
    n = -(-total // target) if target else 1
    if n > 1 and n % 2:
        n += 1
    return max(1, -(-total // n))


def _plan_files(files: list[tuple[str, str, str, str]], target: int) -> list[dict[str, Any]]:
    sizes = [os.path.getsize(Path(root) / rel) for _, _, root, rel in files]
    target = even_target(sum(sizes), target)
    specs: list[dict[str, Any]] = []
    group: list[list[str]] = []
    size = 0
    for (kind, source, root, rel), file_size in zip(files, sizes):
        group.append([source, root, rel])
        size += file_size
        if size >= target:
            specs.append({"kind": kind, "files": group})
            group, size = [], 0
    if group:
        specs.append({"kind": files[0][0], "files": group})
    return specs


def _line_ends(path: Path, cap: int, chunk: int = 8 << 20) -> Iterator[tuple[Any, Any]]:
    """Per block of the file: (end offset of each line, the lines' cumulative weight at that end), a line weighing
    its bytes up to `cap`. A last line without a newline ends at the file's end."""
    import numpy as np

    pos = line_start = weight = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            ends = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == ord("\n")) + (pos + 1)
            lengths = np.diff(ends, prepend=line_start)
            cum = np.cumsum(np.minimum(lengths, cap), dtype=np.int64) + weight
            if len(ends):
                line_start, weight = int(ends[-1]), int(cum[-1])
            pos += len(block)
            yield ends, cum
    if line_start < pos:
        yield np.array([pos]), np.array([weight + min(pos - line_start, cap)])


def _plan_jsonl(path: Path, target: int, cap: int) -> list[dict[str, Any]]:
    """Byte ranges ending at a newline, each knowing the number of its first line, cut into an even number of shards
    of about the same weight: a line weighs its bytes, up to `cap` (see plan_shards)."""
    import numpy as np

    total = 0
    for _, cum in _line_ends(path, cap):
        total = int(cum[-1]) if len(cum) else total
    target = even_target(total, target)
    specs: list[dict[str, Any]] = []
    start = start_weight = lines_before = 0
    first_line = 1
    for ends, cum in _line_ends(path, cap):
        # a shard ends with the first line whose end weighs more than `target` past the shard's start; with every
        # line under the cap, weight is bytes, and that is the line holding byte start + target
        while (k := int(np.searchsorted(cum, start_weight + target, side="right"))) < len(ends):
            specs.append({"kind": "jsonl", "path": str(path), "start": start, "end": int(ends[k]), "first_line": first_line})
            start, start_weight, first_line = int(ends[k]), int(cum[k]), lines_before + k + 2
        lines_before += len(ends)
    size = path.stat().st_size
    if start < size:
        specs.append({"kind": "jsonl", "path": str(path), "start": start, "end": size, "first_line": first_line})
    return specs or [{"kind": "jsonl", "path": str(path), "start": 0, "end": 0, "first_line": 1}]


def _plan_csv(path: Path, target: int, chunk: int = 8 << 20) -> list[dict[str, Any]]:
    """Byte ranges of whole rows after the header, each ending at a newline outside quotes; read in chunks."""
    import numpy as np

    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
        header = next(csv.reader(f), None) or []
    size = path.stat().st_size
    specs: list[dict[str, Any]] = []
    start: int | None = None  # where the current shard starts (None until the header row has ended)
    first_line = want = parity = newlines = pos = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            a = np.frombuffer(block, dtype=np.uint8)
            inside = (np.cumsum(a == ord('"'), dtype=np.int64) + parity) % 2
            nl = a == ord("\n")
            lines = np.cumsum(nl, dtype=np.int64)  # newlines up to and including each byte
            row_ends = np.flatnonzero(nl & (inside == 0))  # a row ends after each of these bytes
            k = 0
            while k < len(row_ends):
                if start is not None:
                    k = int(np.searchsorted(row_ends, want - pos - 1))
                    if k == len(row_ends):
                        break
                    specs.append({"kind": "csv", "path": str(path), "start": start, "end": pos + int(row_ends[k]) + 1,
                                  "first_line": first_line, "header": header})
                start = pos + int(row_ends[k]) + 1
                first_line = newlines + int(lines[row_ends[k]]) + 1
                want = start + target
                k += 1
            parity, newlines, pos = int(inside[-1]), newlines + int(lines[-1]), pos + len(a)
    if start is not None and start < size:
        specs.append({"kind": "csv", "path": str(path), "start": start, "end": size, "first_line": first_line,
                      "header": header})
    return specs or [{"kind": "csv", "path": str(path), "start": size, "end": size, "first_line": 2, "header": header}]


def _plan_parquet(path: Path, target: int) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    specs, group, size, first, row = [], [], 0, 1, 1
    for g in range(meta.num_row_groups):
        group.append(g)
        size += meta.row_group(g).total_byte_size
        row += meta.row_group(g).num_rows
        if size >= target:
            specs.append({"kind": "parquet", "path": str(path), "row_groups": group, "first_row": first})
            group, size, first = [], 0, row
    if group or not specs:
        specs.append({"kind": "parquet", "path": str(path), "row_groups": group, "first_row": first})
    return specs


def read_shard(spec: dict[str, Any], cfg: DataConfig, tally: dict[str, Any]) -> Iterator[RawItem]:
    """Every input unit of one shard as a RawItem; `tally["records_read"]` counts the units from the input."""
    tally.setdefault("records_read", 0)
    reader = {"jsonl": _read_jsonl, "csv": _read_csv, "parquet": _read_parquet, "txt": _read_txt,
              "corpus": _read_corpus, "replay": _read_replay}[spec["kind"]]
    yield from reader(spec, cfg, tally)


def _read_jsonl(spec: dict[str, Any], cfg: DataConfig, tally: dict[str, Any]) -> Iterator[RawItem]:
    path = Path(spec["path"])
    mtime, name = path.stat().st_mtime, path.name
    with open(path, "rb") as f:
        f.seek(spec["start"])
        data = f.read(spec["end"] - spec["start"])
    # split at b"\n" only, as the plan counted: bytes.splitlines() also cuts at a bare \r, which a bad
    # record may hold, and the counts would no longer reconcile
    lines = data.split(b"\n")
    if lines[-1] == b"":  # the range ends with a newline (or is empty): nothing after it
        lines.pop()
    tally["records_read"] += len(lines)
    for n, line in enumerate(lines, spec["first_line"]):
        line = line[:-1] if line.endswith(b"\r") else line  # a CRLF line end; further \r are the record's
        error = ("blank_line", "a blank line holds no record") if not line.strip() else None
        yield RawItem(f"{name}:{n}", line, mtime, source=name, line=n, format="jsonl", raw=line, error=error)


def _read_csv(spec: dict[str, Any], cfg: DataConfig, tally: dict[str, Any]) -> Iterator[RawItem]:
    path = Path(spec["path"])
    mtime, name = path.stat().st_mtime, path.name
    csv.field_size_limit(2**31 - 1)  # a too-long document must reach validation, not crash the reader
    header = spec["header"]
    with open(path, "rb") as f:
        f.seek(spec["start"])
        data = f.read(spec["end"] - spec["start"])
    # surrogateescape keeps undecodable bytes as lone surrogates, which validation reports as invalid_utf8
    text = data.decode("utf-8", "surrogateescape")
    read: list[str] = []  # the lines the current row was parsed from
    reader = csv.reader(_tracked(_newline_lines(text), read))
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as e:  # a \r outside quotes: csv would end a row there, the plan did not
            detail = CR_OUTSIDE_QUOTES if "new-line" in str(e) else f"not a CSV row ({e})"
            tally["records_read"] += 1
            n = spec["first_line"] - 1 + reader.line_num
            raw = "".join(read).removesuffix("\n").removesuffix("\r").encode("utf-8", "surrogateescape")
            read.clear()
            yield RawItem(f"{name}:{n}", {}, mtime, source=name, line=n, format="csv", raw=raw, meta={"header": header},
                          error=("invalid_csv", detail))
            continue
        read.clear()
        tally["records_read"] += 1
        n = spec["first_line"] - 1 + reader.line_num
        error = None
        if len(row) != len(header):
            error = ("column_count", f"{len(row)} cells under a header of {len(header)} columns")
        yield RawItem(f"{name}:{n}", dict(zip(header, row)), mtime, source=name, line=n, format="csv",
                      raw=csv_row_bytes(row), meta={"header": header}, error=error)


def _newline_lines(text: str) -> Iterator[str]:
    """The lines of `text` ended by "\\n" only (kept). csv's own line splitting (a file opened with newline="")
    also ends a line at a bare \\r, so a quoted \\r would throw `line_num` off the plan's count of newlines."""
    start = 0
    while (end := text.find("\n", start)) != -1:
        yield text[start:end + 1]
        start = end + 1
    if start < len(text):
        yield text[start:]


def _tracked(lines: Iterator[str], read: list[str]) -> Iterator[str]:
    for line in lines:
        read.append(line)
        yield line


def _read_parquet(spec: dict[str, Any], cfg: DataConfig, tally: dict[str, Any]) -> Iterator[RawItem]:
    import pyarrow.parquet as pq

    path = Path(spec["path"])
    mtime, name = path.stat().st_mtime, path.name
    pf = pq.ParquetFile(path)
    tally["records_read"] += sum(pf.metadata.row_group(g).num_rows for g in spec["row_groups"])
    n = spec["first_row"]
    for g in spec["row_groups"]:
        for row in pf.read_row_group(g).to_pylist():
            yield RawItem(f"{name}:{n}", row, mtime, source=name, line=n, format="parquet", raw=fields_bytes(row))
            n += 1


def _read_txt(spec: dict[str, Any], cfg: DataConfig, tally: dict[str, Any]) -> Iterator[RawItem]:
    v = cfg.validation
    tally["records_read"] += len(spec["files"])
    for _, root, rel in spec["files"]:
        p = Path(root) / rel
        data = p.read_bytes()
        yield RawItem(rel, {v.id_field: rel, v.text_field: data, v.group_field: rel[: -len(".txt")]}, p.stat().st_mtime,
                      source=rel, line=None, format="txt", raw=data)


def _read_corpus(spec: dict[str, Any], cfg: DataConfig, tally: dict[str, Any]) -> Iterator[RawItem]:
    tally.setdefault("files", 0)
    for source, root, rel in spec["files"]:
        docs, mtime, error, data = extract_file((source, root, rel))
        tally["files"] += 1
        tally["records_read"] += len(docs) + (error is not None)
        if error is not None:
            yield RawItem(f"{source}:{rel}", data, mtime, source=f"{source}:{rel}", line=None, format="py", raw=data,
                          meta={"source": source, "rel": rel}, error=("unparseable_file", error))
        for d in docs:
            yield RawItem(f"{source}:{rel}:{d['qualname'] or '<module>'}", d, mtime, kind="docstring",
                          source=f"{source}:{rel}", line=d["lineno"], format="docstring", raw=fields_bytes(d))


def _read_replay(spec: dict[str, Any], cfg: DataConfig, tally: dict[str, Any]) -> Iterator[RawItem]:
    """Quarantined entries, read back through the parser of their format (after a person fixed `raw`)."""
    from lmforge.components.data.ingest import extract_docstrings, module_name

    for q in iter_quarantine(Path(spec["path"])):
        tally["records_read"] += 1
        payload = replay_fields(q)
        common = {"source": q.source, "line": q.line, "format": q.format, "meta": q.meta}
        origin = f"replay:{q.origin}"
        if q.format == "py":
            try:
                docs = extract_docstrings(payload, source=q.meta["source"], module=module_name(q.meta["rel"]))
            except (SyntaxError, ValueError, RecursionError) as e:
                yield RawItem(origin, payload, 0.0, raw=payload, error=("unparseable_file", f"{type(e).__name__}: {e}"), **common)
                continue
            tally["records_read"] += len(docs) - 1  # one quarantined file became this many docstrings
            for d in docs:
                yield RawItem(f"{origin}:{d['qualname'] or '<module>'}", d, 0.0, kind="docstring", raw=fields_bytes(d),
                              **{**common, "format": "docstring"})
            continue
        error = None
        if q.format == "jsonl" and isinstance(payload, bytes) and not payload.strip():
            error = ("blank_line", "a blank line holds no record")
        if q.format == "csv" and "__columns__" in payload:
            got, want = payload.pop("__columns__")
            error = ("column_count", f"{got} cells under a header of {want} columns")
        if q.format == "csv" and "__invalid__" in payload:
            error = ("invalid_csv", payload.pop("__invalid__"))
        if q.format == "txt":
            v = cfg.validation
            rel = q.source
            payload = {v.id_field: rel, v.text_field: payload, v.group_field: rel[: -len(".txt")]}
        kind = "docstring" if q.format == "docstring" else "document"
        yield RawItem(origin, payload, 0.0, kind=kind, raw=raw_bytes(q), error=error, **common)


# --- all at once, for tests and tools -------------------------------------------------

@dataclass
class Ingested:
    items: list[RawItem]
    report: dict[str, Any] = field(default_factory=dict)


def ingest(cfg: DataConfig, *, progress: Progress | None = None) -> Ingested:
    """All raw items of the configured source in one list, sampled down to `max_docs` with the seed.

    For tests and tools on small inputs; the data stage reads shard by shard.
    """
    path = check_source(cfg.source)
    report: dict[str, Any] = {"source": str(path) if path else "builtin",
                              "corpus": [s for s, _ in corpus_roots(cfg.include_site_packages)] if path is None else None}
    tally: dict[str, Any] = {}
    try:
        items = [it for spec in plan_shards(cfg) for it in read_shard(spec, cfg, tally)]
    except (OSError, csv.Error, UnicodeError) as e:
        raise UserError("data.source", cfg.source, f"could not be read ({type(e).__name__}: {e})",
                        f"Check that it is {SUPPORTED}") from e
    except Exception as e:
        if type(e).__module__.startswith("pyarrow"):
            raise UserError("data.source", cfg.source, f"is not a readable Parquet file ({e})",
                            f"Check that it is {SUPPORTED}") from e
        raise
    assert tally["records_read"] == len(items), (tally, len(items))
    report["items_found"] = len(items)
    if cfg.max_docs is not None and len(items) > cfg.max_docs:
        keep = sorted(random.Random(cfg.seed).sample(range(len(items)), cfg.max_docs))
        items = [items[i] for i in keep]
    report["items_kept"] = len(items)
    if not items:
        raise UserError("data.source", cfg.source or "builtin", "holds no records",
                        f"Point it at {SUPPORTED} with at least one record")
    return Ingested(items, report)
