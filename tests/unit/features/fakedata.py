"""A small dataset folder built to the data stage's contract, for the features and vectors tests.

    version, records = make_dataset(ws, n_train=30, n_val=6, n_test=6)

Writes records/{train,validation,test}.jsonl, features.parquet (quality_score spread over
[0, 1] by position), shards/ (token ids = bytes of record.text, then EOS), manifest.json and
report.json, then sets the LATEST pointer. Nothing here needs the data stage's code.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pandas as pd

from lmforge.components.data.shards import write_shards
from lmforge.components.serving.records import Record
from lmforge.components.workspace import Workspace, atomic_write_json

EOS = 2
VOCAB = 300
TOPICS = ["socket", "json", "path", "thread", "queue", "regex", "email", "heap"]


def encode(text: str) -> list[int]:
    return [4 + b for b in text.encode("utf-8")][:200] + [EOS]


def make_record(split: str, i: int) -> Record:
    topic = TOPICS[i % len(TOPICS)]
    return Record.from_parts(
        source="fake", module=f"{split}_{topic}_mod{i // len(TOPICS)}", qualname=f"{topic}_op_{i}",
        signature=f"def {topic}_op_{i}({topic}, timeout=None)",
        docstring=f"Open the {topic} number {i} and return its {topic} handle.\n\nRaises OSError when the {topic} fails.")


def make_dataset(ws: Workspace, *, n_train: int = 30, n_val: int = 6, n_test: int = 6, version: str = "fakev1",
                 built: datetime | None = None, drop_features_for: int = 0) -> tuple[str, dict[str, list[Record]]]:
    """`drop_features_for` = how many train documents (the last ones) get no features row."""
    built = built or datetime.now(timezone.utc).replace(microsecond=0) - timedelta(minutes=5)
    records = {s: [make_record(s, i) for i in range(n)] for s, n in (("train", n_train), ("validation", n_val), ("test", n_test))}
    ds = ws.dataset_dir(version)
    for split, recs in records.items():
        path = ds / "records" / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in recs))
    rows = []
    for split, recs in records.items():
        keep = recs[: len(recs) - drop_features_for] if split == "train" else recs
        for i, r in enumerate(keep):
            words = r.text.split()
            rows.append({"doc_id": r.id, "split": split, "module": r.module, "event_timestamp": built,
                         "created_timestamp": built, "n_chars": len(r.text), "n_words": len(words),
                         "alpha_ratio": 0.8, "digit_ratio": 0.01, "punct_ratio": 0.05, "n_lines": r.text.count("\n") + 1,
                         "cluster_size": 1 + i % 3, "quality_score": round(i / max(len(recs) - 1, 1), 4)})
    pd.DataFrame(rows).to_parquet(ds / "features.parquet", index=False)
    write_shards(ds / "shards", {s: [encode(r.text) for r in recs] for s, recs in records.items()}, vocab_size=VOCAB)
    counts = {s: len(r) for s, r in records.items()}
    atomic_write_json(ds / "manifest.json", {"version": version, "counts": counts, "created_at": built.isoformat()})
    atomic_write_json(ds / "report.json", {"counts": counts})
    ws.set_latest_dataset(version)
    return version, records
