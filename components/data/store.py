"""JSONL files of the data stage: kept records with their provenance, and quarantine entries.

    sha = write_kept(path, kept)                # atomic; returns the file's SHA-256
    kept = read_kept(path)                      # list[Kept]
    write_records(path, records)                # plain Record dicts (the dataset's records/*.jsonl)
    records = read_records(path)                # list[Record]
    write_quarantine(path, entries)             # one JSON object per bad record

Every write goes through a temporary file renamed into place, and returns the hash of
what was written, so a task can hand on a small (path, hash) reference.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from lmforge.components.data.records import Record
from lmforge.components.data.validate import Kept, Quarantined
from lmforge.components.workspace import atomic_file


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]], *, ascii_only: bool = False) -> str:
    h = hashlib.sha256()
    with atomic_file(Path(path), "wb") as f:
        for row in rows:
            line = (json.dumps(row, ensure_ascii=ascii_only, sort_keys=True) + "\n").encode("utf-8")
            h.update(line)
            f.write(line)
    return h.hexdigest()


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def write_kept(path: Path, kept: Iterable[Kept], extra: Iterable[dict[str, Any]] | None = None) -> str:
    """Kept records with origin and mtime, and optional per-row extras (e.g. cluster_size, split)."""
    extras = iter(extra) if extra is not None else None
    return write_jsonl(path, ({"record": k.record.to_dict(), "origin": k.origin, "mtime": k.mtime,
                               **(next(extras) if extras is not None else {})} for k in kept))


def read_kept(path: Path) -> tuple[list[Kept], list[dict[str, Any]]]:
    """The kept records and, per row, any extras written with them."""
    kept, extras = [], []
    for row in iter_jsonl(path):
        kept.append(Kept(Record.from_dict(row.pop("record")), row.pop("origin"), row.pop("mtime")))
        extras.append(row)
    return kept, extras


def write_records(path: Path, records: Iterable[Record]) -> str:
    return write_jsonl(path, (r.to_dict() for r in records))


def read_records(path: Path) -> list[Record]:
    return [Record.from_dict(d) for d in iter_jsonl(path)]


def write_quarantine(path: Path, entries: Iterable[Quarantined]) -> str:
    return write_jsonl(path, (q.to_dict() for q in entries), ascii_only=True)


def read_quarantine(path: Path) -> list[Quarantined]:
    return [Quarantined(**d) for d in iter_jsonl(path)]
