"""What the data stage's steps hand each other: a build folder, the SHA-256 of each file in it, and the step's counts.

    ing = IngestRef.of(out, [ROWS, QUARANTINE, SIG], index=3, records_read=120, rows=110, quarantined=10,
                       quarantined_by_reason={"invalid_json": 10}, files_read=0)
    ing.path(ROWS)       # Path(out) / "rows.parquet"
    ing.verified()       # False once a file it names is gone or changed
    ing.model_dump(mode="json")   # a plain dict, the same keys as the fields

One base, `StepRef` (dir + files), and one subclass per step with that step's typed
counts: IngestRef, RecordsRef and FinishRef per shard (components/data/shardwork.py); SelectRef,
NearRef, SplitRef and TokenizerRef for the corpus-wide steps (components/data/corpuswork.py);
DecideRef holds the first three, which one task makes.

They are frozen pydantic models, not dataclasses: Prefect persists task results with its
JSON serializer, which writes a pydantic model with its class name and validates it back
into the same class; and task cache keys hash the inputs through the same JSON form.
Tasks hand each other these small references, never the documents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict

from lmforge.components.workspace import sha256_file


class StepRef(BaseModel):
    """A step's output folder and the SHA-256 of each file in it that later steps read."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dir: str
    files: dict[str, str]

    @classmethod
    def of(cls, out: Path | str, files: list[str], **fields: Any) -> Self:
        """The reference to `out`, hashing each of `files` now (after the step wrote them)."""
        return cls(dir=str(out), files={f: sha256_file(Path(out) / f) for f in files}, **fields)

    def path(self, name: str) -> Path:
        return Path(self.dir) / name

    def verified(self) -> bool:
        """True when every file this reference names still has the recorded SHA-256 (a cache hit may be stale)."""
        return all(self.path(f).is_file() and sha256_file(self.path(f)) == h for f, h in self.files.items())


class IngestRef(StepRef):
    """One input shard read, validated and cleaned: rows.parquet, quarantine.jsonl, sig.npy."""

    index: int
    records_read: int
    rows: int
    quarantined: int
    quarantined_by_reason: dict[str, int]
    files_read: int


class SelectRef(StepRef):
    """Sampling, duplicate ids and exact duplicates over the corpus: unique-/exact-<i>.npy, quarantine.jsonl."""

    records_read: int
    docs_in: int
    sampled_out: int
    clean: int
    exact_duplicates: int
    quarantined: int
    quarantined_by_reason: dict[str, int]


class NearRef(StepRef):
    """MinHash LSH near-duplicate removal: keep-/cluster-<i>.npy."""

    near_duplicates: int
    kept: int
    lsh: dict[str, int]
    examples: list[dict[str, int]]


class SplitRef(StepRef):
    """split.json: the groups placed outside train, and the documents and groups in each split."""

    counts: dict[str, int]
    groups: dict[str, int]


class DecideRef(BaseModel):
    """The three corpus-wide decisions one task makes in a row (flows/data.py): select, near-dedup, split."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    select: SelectRef
    near: NearRef
    split: SplitRef

    def verified(self) -> bool:
        return all(r.verified() for r in (self.select, self.near, self.split))


class TokenizerRef(StepRef):
    """tokenizer.json, its tree hash (what the finish step's cache key uses) and what it was trained on."""

    sha256: str
    vocab_size: int
    trained_on: dict[str, int]


class RecordsRef(StepRef):
    """One shard's kept documents with their split: records-<split>.jsonl, features.parquet."""

    index: int
    counts: dict[str, int]
    quality_sum: float


class FinishRef(StepRef):
    """One shard's kept documents' token ids per split: tokens-/lengths-<split>.npy."""

    index: int
    counts: dict[str, int]
    tokens: dict[str, int]
