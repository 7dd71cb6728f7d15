"""Training-set selection: a point-in-time join of the train split's documents, then a quality filter.

    result = select_training_set(ws, "3f2a9c1b7d0e", FeaturesConfig(min_quality=0.4))
    result["selected"], result["rejected"], result["missing_features"]
    ws.training_shards("3f2a9c1b7d0e")     # now <dataset>/selected/shards

Each train document is joined, as of the dataset's feature time (its newest
created_timestamp), with the `training_v1` feature service through
`get_historical_features`. A document with no features in the ttl window is counted as
`missing_features` and not selected; that is a count in the report, never a crash.

Writes `<dataset>/selected/` (shards in components/data/shards.py format, train = the
selected documents, validation/test unchanged, plus selection.json) in one atomic rename,
and adds the counts to the dataset's report.json under "feature_selection".
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lmforge.components.data.shards import open_offsets, open_shard, read_index, write_shards
from lmforge.components.errors import UserError
from lmforge.components.features.offline import read_dataset_features
from lmforge.components.features.store import open_store
from lmforge.components.sections.features import FeaturesConfig
from lmforge.components.workspace import Workspace, atomic_dir, atomic_write_json

SERVICE = "training_v1"


def read_ids(ws: Workspace, version: str, split: str) -> list[str]:
    path = ws.dataset_dir(version) / "records" / f"{split}.jsonl"
    if not path.is_file():
        raise UserError("dataset", ws.dataset_dir(version), f"has no records/{split}.jsonl",
                        "Re-run the data stage: lmforge run data")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["id"] for line in f if line.strip()]


def historical_features(ws: Workspace, cfg: FeaturesConfig, entities: pd.DataFrame) -> pd.DataFrame:
    """training_v1 features for each (doc_id, event_timestamp) row of `entities`: one row each, in order.

    Point in time: the newest feature row with event time in [t - ttl, t] that was also
    written (created_timestamp) by t, so a later backfill never changes a past selection.
    Feast's file store leaves out an entity row whose only feature rows fell outside the
    ttl, and merges repeated rows; merging back onto `entities` restores them (as nulls).
    """
    store = open_store(ws, cfg)
    keys = entities[["doc_id", "event_timestamp"]].copy()
    keys["event_timestamp"] = pd.to_datetime(keys["event_timestamp"], utc=True).astype("datetime64[ns, UTC]")
    job = store.get_historical_features(entity_df=keys.drop_duplicates(), features=store.get_feature_service(SERVICE),
                                        filter_by_created_timestamp=True)
    got = job.to_df()
    got["event_timestamp"] = pd.to_datetime(got["event_timestamp"], utc=True).astype("datetime64[ns, UTC]")
    out = keys.merge(got, on=["doc_id", "event_timestamp"], how="left", validate="many_to_one")
    assert len(out) == len(keys)
    return out


def quality_filter(df: pd.DataFrame, cfg: FeaturesConfig) -> pd.Series:
    """Per document: "" when kept, else the first reason it is rejected."""
    reason = pd.Series("", index=df.index, dtype=object)
    checks = [
        ("missing_features", df["quality_score"].isna()),
        ("low_quality", df["quality_score"] < cfg.min_quality),
        ("too_short", df["n_words"] < cfg.min_words),
    ]
    if cfg.max_cluster_size is not None:
        checks.append(("large_cluster", df["cluster_size"] > cfg.max_cluster_size))
    for name, mask in checks:
        reason[(reason == "") & mask.fillna(False).astype(bool)] = name
    return reason


def select_training_set(ws: Workspace, version: str, cfg: FeaturesConfig) -> dict[str, Any]:
    ds = ws.dataset_dir(version)
    ids = read_ids(ws, version, "train")
    feats = read_dataset_features(ws, version)
    as_of = feats["created_timestamp"].max() if len(feats) else pd.Timestamp.now(tz="UTC")
    joined = historical_features(ws, cfg, pd.DataFrame({"doc_id": ids, "event_timestamp": as_of}))
    reason = quality_filter(joined, cfg)
    keep = (reason == "").to_numpy()
    by_reason = dict(Counter(r for r in reason if r))
    result = {
        "dataset_version": version,
        "feature_service": SERVICE,
        "as_of": as_of.isoformat(),
        "train_docs": len(ids),
        "selected": int(keep.sum()),
        "rejected": int((~keep).sum()),
        "missing_features": by_reason.get("missing_features", 0),
        "rejected_by_reason": by_reason,
        "filter": cfg.model_dump(mode="json", include={"min_quality", "min_words", "max_cluster_size"}),
    }
    if ids and not keep.any():
        raise UserError("features.min_quality", cfg.min_quality,
                        f"rejects every one of the {len(ids)} training documents ({by_reason})",
                        "Lower features.min_quality / features.min_words, or check the data stage's features.parquet")
    with atomic_dir(ds / "selected") as tmp:
        result["shards"] = _write_selected_shards(ds / "shards", tmp / "shards", keep)
        atomic_write_json(tmp / "selection.json", {**result, "selected_ids": [i for i, k in zip(ids, keep) if k]})
    update_report(ds, "feature_selection", result)
    return result


def clear_selection(ws: Workspace, version: str) -> bool:
    """Remove a previous selection, so training reads the whole train split again. True when one existed."""
    selected = ws.dataset_dir(version) / "selected"
    if not selected.exists():
        return False
    # Renamed first: training never sees a half-deleted selection.
    doomed = selected.with_name(f".selected.removed-{os.getpid()}")
    os.replace(selected, doomed)
    shutil.rmtree(doomed)
    update_report(ws.dataset_dir(version), "feature_selection", None)
    return True


def update_report(ds: Path, key: str, value: Any) -> None:
    """Set one key of the dataset's report.json (created if the data stage wrote none)."""
    path = ds / "report.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    report[key] = value
    atomic_write_json(path, report)


def _documents(shard_dir: Path, split: str) -> list[np.ndarray]:
    tokens = open_shard(shard_dir, split)
    starts = open_offsets(shard_dir, split)
    ends = np.append(starts[1:], len(tokens)).astype(np.int64)
    return [np.asarray(tokens[s:e]) for s, e in zip(starts, ends)]


def _write_selected_shards(src: Path, out: Path, keep: np.ndarray) -> dict[str, Any]:
    index = read_index(src)
    splits: dict[str, list[np.ndarray]] = {}
    for split in index["splits"]:
        docs = _documents(src, split)
        if split == "train":
            if len(docs) != len(keep):
                raise UserError("dataset", src.parent, f"has {len(docs)} train shard documents but {len(keep)} train records",
                                "The dataset is inconsistent; re-run the data stage: lmforge run data")
            docs = [d for d, k in zip(docs, keep) if k]
        splits[split] = docs
    written = write_shards(out, splits, vocab_size=index["vocab_size"])
    return {name: {"docs": s["docs"], "tokens": s["tokens"]} for name, s in written["splits"].items()}
