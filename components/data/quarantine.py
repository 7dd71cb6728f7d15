"""Quarantine entries that keep each bad record whole, so that it can be fixed and replayed.

    q = quarantine_entry(item, "invalid_json", "Expecting value at column 1")   # item: RawItem
    q.to_dict()      # {"source", "line", "origin", "reason", "detail", "format", "raw" | "raw_b64", "meta"}
    raw_bytes(q)     # the record exactly as it was read
    write_quarantine(path, entries); read_quarantine(path)
    items = list(replay_items(read_quarantine(path)))   # RawItems again, for `lmforge data replay`

`raw` holds the record's bytes as text when they are UTF-8, `raw_b64` (base64) when they
are not; exactly one of the two is set. What the raw bytes are depends on the format:
a JSONL line, a CSV row (re-serialised, with the header in `meta`), a Parquet row or a
built-in docstring as JSON (binary values as {"$b64": ...}), a .txt or .py file's bytes.
A person fixes `raw` in the file; `replay_items` reads it back through the same parsers.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.workspace import atomic_file

FORMATS = ("jsonl", "csv", "parquet", "txt", "docstring", "py")
CR_OUTSIDE_QUOTES = "a carriage return (\\r) outside quotes, and rows end at \\n only: quote the cell that holds it, or remove it"


@dataclass(frozen=True)
class Quarantined:
    origin: str
    reason: str
    detail: str
    source: str = ""
    line: int | None = None
    format: str = "jsonl"
    raw: str | None = None
    raw_b64: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def encode_raw(data: bytes) -> dict[str, str | None]:
    """{"raw": text} when the bytes are UTF-8 (lone surrogates included: they cannot be written), else raw_b64."""
    try:
        text = data.decode("utf-8")
        return {"raw": text, "raw_b64": None}
    except UnicodeDecodeError:
        return {"raw": None, "raw_b64": base64.b64encode(data).decode("ascii")}


def raw_bytes(q: Quarantined) -> bytes:
    if q.raw_b64 is not None:
        return base64.b64decode(q.raw_b64)
    assert q.raw is not None, "a quarantine entry holds raw or raw_b64"
    return q.raw.encode("utf-8", "surrogateescape")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return {"$b64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "surrogateescape")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _unjson(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$b64"}:
            return base64.b64decode(value["$b64"])
        return {k: _unjson(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unjson(v) for v in value]
    return value


def fields_bytes(fields: dict[str, Any]) -> bytes:
    """A dict record (Parquet row, built-in docstring) as the JSON bytes the quarantine keeps."""
    text = json.dumps(_jsonable(fields), ensure_ascii=False, sort_keys=True)
    return text.encode("utf-8", "surrogateescape")


def csv_row_bytes(row: list[str]) -> bytes:
    """One CSV row without its line end. csv quotes a cell holding a character of the line terminator, so
    "\\r\\n" makes it quote a cell with a bare \\r as well as one with \\n: unquoted, it would not read back."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\r\n").writerow(row)
    return buf.getvalue().removesuffix("\r\n").encode("utf-8", "surrogateescape")


def quarantine_entry(item: Any, reason: str, detail: str) -> Quarantined:
    """The entry for a RawItem (components/data/ingest.py) judged bad for `reason`."""
    return Quarantined(origin=item.origin, reason=reason, detail=detail, source=item.source, line=item.line,
                       format=item.format, meta=dict(item.meta), **encode_raw(item.raw))


def entry_sha(q: Quarantined) -> str:
    return hashlib.sha256(json.dumps(q.to_dict(), sort_keys=True).encode("utf-8", "surrogateescape")).hexdigest()


def write_quarantine(path: Path, entries: Iterable[Quarantined]) -> int:
    """Write one JSON object per entry (ASCII, so any bytes survive); returns how many were written."""
    n = 0
    with atomic_file(Path(path), "wb") as f:
        for q in entries:
            f.write((json.dumps(q.to_dict(), ensure_ascii=True, sort_keys=True) + "\n").encode("ascii"))
            n += 1
    return n


def iter_quarantine(path: Path) -> Iterator[Quarantined]:
    with open(path, encoding="utf-8", newline="\n") as f:  # lines end at \n only, as the data stage wrote them
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                yield Quarantined(**d)
            except (json.JSONDecodeError, TypeError) as e:
                raise UserError("quarantine file", f"{path}:{n}", f"is not a quarantine entry ({e})",
                                "Keep one JSON object per line with the keys the data stage wrote; edit only 'raw'") from None


def read_quarantine(path: Path) -> list[Quarantined]:
    return list(iter_quarantine(path))


def replay_fields(q: Quarantined) -> bytes | dict[str, Any]:
    """The payload a reader would have produced for this entry's (possibly fixed) raw bytes."""
    data = raw_bytes(q)
    if q.format == "jsonl":
        return data
    if q.format in ("parquet", "docstring"):
        try:
            return _unjson(json.loads(data.decode("utf-8", "surrogateescape")))
        except json.JSONDecodeError:
            return data  # still not a JSON object: validation quarantines it again as invalid_json
    if q.format == "csv":
        header = list(q.meta.get("header", []))
        try:  # StringIO's lines end at \n only, as the reader's do
            (row,) = list(csv.reader(io.StringIO(data.decode("utf-8", "surrogateescape")))) or [[]]
        except csv.Error as e:
            return {"__invalid__": CR_OUTSIDE_QUOTES if "new-line" in str(e) else f"not a CSV row ({e})"}
        fields: dict[str, Any] = dict(zip(header, row))
        if len(row) != len(header):
            fields["__columns__"] = (len(row), len(header))
        return fields
    if q.format == "txt":
        return data
    if q.format == "py":
        return data
    raise UserError("quarantine entry", q.origin, f"has an unknown format {q.format!r}", f"Use one of {', '.join(FORMATS)}")
