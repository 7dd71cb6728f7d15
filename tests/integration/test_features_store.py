"""The features stage for real: Feast apply + materialise + point-in-time selection, Qdrant, retrieval, the CLI.

One workspace per module (Feast apply takes ~17 s here): a fake dataset to the data stage's
contract, plus extra offline rows with timestamps before, at and after the entity times and
beyond the ttl; then the real features flow runs once over it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lmforge.components.data.shards import open_offsets, read_index
from lmforge.components.features.offline import write_offline
from lmforge.components.workspace import Workspace
from tests.conftest import REPO, TINY_CONFIG
from tests.unit.features.fakedata import make_dataset

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TTL = timedelta(days=365)          # as declared in feature_repo/feature_definitions.py
NOW = datetime.now(timezone.utc).replace(microsecond=0)
T = NOW - timedelta(days=30)       # the reference time; rows "after" it are still in the past
DAY = timedelta(days=1)
BUILT = NOW - 400 * DAY            # the fake dataset's source time


def pit_rows() -> pd.DataFrame:
    """Rows for three documents around T; value = quality_score identifies the row."""
    def row(doc, event, value, created=None):
        return {"doc_id": doc, "split": "train", "module": "pit", "event_timestamp": event,
                "created_timestamp": created or event, "n_chars": int(value * 1000), "n_words": 10, "n_lines": 1,
                "alpha_ratio": 0.5, "digit_ratio": 0.0, "punct_ratio": 0.0, "cluster_size": 1, "quality_score": value}
    return pd.DataFrame([
        row("pit-a", T - 400 * DAY, 0.11),                                # beyond the ttl as of T
        row("pit-a", T - 10 * DAY, 0.22),                                 # before
        row("pit-a", T - 3 * DAY, 0.27, created=T - DAY),                 # before, but written later (a backfill)
        row("pit-a", T, 0.33),                                            # at
        row("pit-a", T + DAY, 0.44),                                      # after
        row("pit-b", T - 400 * DAY, 0.55),                                # only beyond the ttl
        row("pit-c", T + 2 * DAY, 0.66),                                  # only after
    ])


def as_of_reference(rows: pd.DataFrame, doc: str, t: pd.Timestamp) -> float | None:
    """Brute force: the newest row with t - ttl <= event <= t that was written (created) by t."""
    r = rows[(rows.doc_id == doc) & (rows.event_timestamp <= t) & (rows.event_timestamp >= t - TTL)
             & (rows.created_timestamp <= t)]
    if r.empty:
        return None
    return float(r.sort_values(["event_timestamp", "created_timestamp"]).iloc[-1].quality_score)


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    from lmforge.components.config import load_config

    root = tmp_path_factory.mktemp("features") / "ws"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMFORGE_HOME", str(root))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        ws = Workspace(root).ensure()
        # Event times are source-file times, often older than the ttl: materialisation must backfill them.
        version, records = make_dataset(ws, n_train=40, n_val=8, n_test=8, built=BUILT, drop_features_for=2)
        rows = pit_rows()
        write_offline(ws, "pit", rows)
        from lmforge.flows.features import features_flow

        cfg = load_config(TINY_CONFIG, ["features.min_quality=0.25", "vectors.near_dup_threshold=0.9"])
        result = features_flow(cfg)
        yield {"ws": ws, "version": version, "records": records, "rows": rows, "result": result, "cfg": cfg}
        from lmforge.components.vectors.index import close_clients

        close_clients()


def test_flow_selects_a_quality_filtered_training_set(stage):
    ws, version, records, result = stage["ws"], stage["version"], stage["records"], stage["result"]
    summary = result["summary"]
    n_train = len(records["train"])
    assert summary["selected"] + summary["rejected"] == n_train
    assert summary["missing_features"] == 2
    # quality_score = i / 39 for the 38 train docs with features: those >= 0.25 are kept.
    expected = [r.id for i, r in enumerate(records["train"][:-2]) if round(i / 39, 4) >= 0.25]
    selection = json.loads((ws.dataset_dir(version) / "selected" / "selection.json").read_text())
    assert selection["selected_ids"] == expected and summary["selected"] == len(expected)
    assert selection["rejected_by_reason"] == {"missing_features": 2, "low_quality": n_train - 2 - len(expected)}
    # Training reads the selection; its train shard is exactly the selected documents' tokens.
    shards = ws.training_shards(version)
    assert shards == ws.dataset_dir(version) / "selected" / "shards"
    index, full = read_index(shards), read_index(ws.dataset_dir(version) / "shards")
    assert index["splits"]["train"]["docs"] == len(expected)
    assert index["splits"]["validation"] == full["splits"]["validation"]
    keep = [i for i, r in enumerate(records["train"]) if r.id in set(expected)]
    src = np.fromfile(ws.dataset_dir(version) / "shards" / "train.bin", dtype=full["dtype"])
    starts = list(open_offsets(ws.dataset_dir(version) / "shards", "train")) + [len(src)]
    want = np.concatenate([src[starts[i]:starts[i + 1]] for i in keep])
    assert np.array_equal(np.fromfile(shards / "train.bin", dtype=index["dtype"]), want)
    # The counts are in the data report, beside the semantic near-duplicates.
    report = json.loads((ws.dataset_dir(version) / "report.json").read_text())
    assert report["feature_selection"]["selected"] == len(expected) and report["counts"]["train"] == n_train
    assert report["semantic_near_duplicates"]["pairs_found"] == summary["semantic_near_dups"] > 0
    assert summary["indexed"] == sum(len(r) for r in records.values())
    assert result["materialize"]["backfilled_from"] == BUILT.isoformat()


def test_historical_features_match_a_brute_force_as_of_join(stage):
    from lmforge.components.features.selection import historical_features

    rows = stage["rows"]
    offsets = [-500, -400, -380, -200, -10.5, -10, -9.9, -5, -3, -2, -0.5, -0.01, 0, 0.5, 1, 2, 3, 20]
    entity = pd.DataFrame([(doc, T + off * DAY) for doc in ("pit-a", "pit-b", "pit-c", "never-seen") for off in offsets],
                          columns=["doc_id", "event_timestamp"])
    entity = pd.concat([entity, entity.iloc[:3]], ignore_index=True)       # repeated requests stay separate rows
    got = historical_features(stage["ws"], stage["cfg"].features, entity)
    assert list(got["doc_id"]) == list(entity["doc_id"])
    outcomes = set()
    for doc, t, value in zip(entity["doc_id"], entity["event_timestamp"], got["quality_score"]):
        want = as_of_reference(rows, doc, t)
        assert (want is None and pd.isna(value)) or value == pytest.approx(want), (doc, t, value, want)
        outcomes.add(want)
    # Every case happened: beyond the ttl, before/at/after, the backfill hidden and then visible, nothing at all.
    assert {None, 0.11, 0.22, 0.27, 0.33, 0.44, 0.55, 0.66} <= outcomes


def test_online_values_equal_offline_after_materialisation(stage):
    """Online = the newest materialised row; offline as of a time after every row of that document."""
    from lmforge.components.features.online import online_features
    from lmforge.components.features.selection import historical_features

    ws, cfg, records = stage["ws"], stage["cfg"].features, stage["records"]
    dataset_ids = [r.id for recs in records.values() for r in recs]
    ids = dataset_ids + ["pit-a", "pit-b", "pit-c", "never-seen"]
    online, missing = online_features(ws, cfg, ids)
    now = pd.Timestamp(datetime.now(timezone.utc))
    times = [BUILT + timedelta(minutes=1)] * len(dataset_ids) + [now] * 4
    offline = historical_features(ws, cfg, pd.DataFrame({"doc_id": ids, "event_timestamp": times})).set_index("doc_id")
    assert set(missing) == {i for i in ids if pd.isna(offline.loc[i, "quality_score"])}
    assert set(missing) == {"pit-b", "never-seen", *(r.id for r in records["train"][-2:])}
    for doc_id, values in online.items():
        assert values["quality_score"] == pytest.approx(offline.loc[doc_id, "quality_score"])
        assert (values["split"], values["module"]) == (offline.loc[doc_id, "split"], offline.loc[doc_id, "module"])
    assert online["pit-a"]["quality_score"] == pytest.approx(0.44) and len(online) == len(ids) - 4


def test_retrieve_ranks_training_examples_by_online_quality(stage):
    from lmforge.components.vectors.retrieval import retrieve

    ws, cfg, records = stage["ws"], stage["cfg"], stage["records"]
    train = {r.id: i for i, r in enumerate(records["train"])}
    for rec in records["test"][:3]:
        got = retrieve(rec.signature, 4, ws=ws, vectors=cfg.vectors, features=cfg.features)
        assert len(got) == 4 and all(g.id in train for g in got)
        assert all(g.quality is not None and g.quality >= cfg.features.min_quality for g in got)
        w = cfg.vectors.quality_weight
        ranks = [(1 - w) * g.score + w * g.quality for g in got]
        assert ranks == sorted(ranks, reverse=True)


def test_feast_cli_plans_from_the_repo_root_against_the_workspace(stage):
    env = {**os.environ, "LMFORGE_HOME": str(stage["ws"].root)}
    feast = Path(sys.executable).parent / "feast"
    out = subprocess.run([str(feast), "-c", "feature_repo", "plan"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert str(stage["ws"].root / "features" / "offline" / "document_quality") in out.stdout


def test_online_store_never_regresses_to_an_older_value_brute_force(stage):
    """Rounds of versions published in random time order, each materialised with a backfill: brute force says
    the online value is always the one with the newest event time."""
    import random
    import time

    from lmforge.components.features.online import online_features
    from lmforge.components.features.store import materialize

    ws, cfg = stage["ws"], stage["cfg"]
    rng = random.Random(7)
    docs = [f"mono-{i}" for i in range(6)]
    published: list[dict] = []
    for round_ in range(3):
        time.sleep(1.1)  # new rows land after the last materialisation's end: in the incremental range
        now = datetime.now(timezone.utc) - timedelta(seconds=1)
        rows = []
        for d in docs:
            old = now - timedelta(days=rng.randint(30, 900))  # an older version, published late (a backfill)
            for event, value in ((now, round(rng.random(), 4)), (old, round(rng.random(), 4))):
                rows.append({"doc_id": d, "split": "train", "module": "mono", "event_timestamp": event,
                             "created_timestamp": event, "n_chars": 10, "n_words": 10, "n_lines": 1, "alpha_ratio": 0.5,
                             "digit_ratio": 0.0, "punct_ratio": 0.0, "cluster_size": 1, "quality_score": value})
        published += rows
        write_offline(ws, f"mono-{round_}", pd.DataFrame(rows))
        since = min(r["event_timestamp"] for r in rows)
        materialize(ws, cfg.features, since=since)
        found, missing = online_features(ws, cfg.features, docs)
        assert not missing
        for d in docs:
            newest = max((r for r in published if r["doc_id"] == d), key=lambda r: r["event_timestamp"])
            assert found[d]["quality_score"] == pytest.approx(newest["quality_score"]), (round_, d)
