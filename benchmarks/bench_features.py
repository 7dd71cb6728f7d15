"""Feature store and vector database latencies, each against a plain baseline in the same run.

    .venv/bin/python benchmarks/bench_features.py                  # ~4-6 min on 2 cores
    .venv/bin/python benchmarks/bench_features.py --rows 20000 --points 2000 20000
    .venv/bin/python benchmarks/bench_features.py --parts vectors --points 100000   # the vector part alone

Feast (the project's feature_repo, applied to a temporary workspace, local provider):
- get_online_features p50/p99 for 1 and 100 entities (serving_v1, SQLite online store),
  against a raw sqlite3 SELECT of the same keys from Feast's own online table;
- get_historical_features wall time for 10k and 100k entity rows over an offline source of
  `--rows` documents (with our point-in-time semantics: ttl and created-time cutoff),
  against pandas.merge_asof computing the same join.
Qdrant's embedded engine (qdrant-edge-py, as the pipeline runs it without vectors.url: a shard on
disk with its WAL, HNSW built by the optimiser): the index build time (upserts, then the HNSW
graph), and search p50/p99 for the top 10 at 10k and 100k points (384-dim, like
all-MiniLM-L6-v2), one query at a time, against exact numpy brute force (a dot product with
every vector, then the top 10) for the same query, plus the engine's recall@10 against that
exact answer. Targets at 100k: p50 latency <= 0.2x brute force, recall@10 >= 0.95.
`--parts vectors` runs the vector part alone (it then writes vectors.json / vectors.md).

Writes benchmarks/results/features.json and features.md.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from importlib import metadata
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._report import write_results  # noqa: E402


def pct(samples: list[float]) -> tuple[float, float]:
    a = np.asarray(samples) * 1000
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def synthetic_rows(n: int, now: datetime, rng: np.random.Generator) -> pd.DataFrame:
    """n documents, each with two versions of its features (an older and a newer event)."""
    ids = [f"doc{i:07d}" for i in range(n)]
    frames = []
    for age_days in (40, 5):
        event = now - timedelta(days=age_days)
        frames.append(pd.DataFrame({
            "doc_id": ids, "split": rng.choice(["train", "validation", "test"], n, p=[0.9, 0.05, 0.05]),
            "module": [f"mod{i % 500}" for i in range(n)], "event_timestamp": event, "created_timestamp": event,
            "n_chars": rng.integers(20, 4000, n), "n_words": rng.integers(3, 600, n), "n_lines": rng.integers(1, 80, n),
            "alpha_ratio": rng.random(n), "digit_ratio": rng.random(n) * 0.1, "punct_ratio": rng.random(n) * 0.2,
            "cluster_size": rng.integers(1, 4, n), "quality_score": rng.random(n)}))
    return pd.concat(frames, ignore_index=True)


def bench_feast(rows: int, entity_sizes: list[int], repeats: int, root: Path) -> dict:
    os.environ["LMFORGE_HOME"] = str(root)
    from lmforge.components.features.offline import write_offline
    from lmforge.components.features.selection import historical_features
    from lmforge.components.features.store import apply_repo, materialize, open_store
    from lmforge.components.sections.features import FeaturesConfig
    from lmforge.components.workspace import Workspace

    ws, cfg = Workspace(root).ensure(), FeaturesConfig()
    rng = np.random.default_rng(0)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    data = synthetic_rows(rows, now, rng)
    write_offline(ws, "bench", data)
    t0 = time.perf_counter()
    apply_repo(ws, cfg)
    t_apply = time.perf_counter() - t0
    t0 = time.perf_counter()
    materialize(ws, cfg)
    t_mat = time.perf_counter() - t0
    store = open_store(ws, cfg)
    service = store.get_feature_service("serving_v1")
    ids = data["doc_id"].unique()
    out: dict = {"rows": len(data), "documents": rows, "apply_s": round(t_apply, 2), "materialize_s": round(t_mat, 2),
                 "online": {}, "historical": {}}

    db = sqlite3.connect(str(ws.features / "online_store.db"))
    table = next(r[0] for r in db.execute("select name from sqlite_master where type='table'") if "document_quality" in r[0])
    from feast.infra.key_encoding_utils import serialize_entity_key
    from feast.protos.feast.types.EntityKey_pb2 import EntityKey
    from feast.protos.feast.types.Value_pb2 import Value

    def raw_keys(batch):
        return [serialize_entity_key(EntityKey(join_keys=["doc_id"], entity_values=[Value(string_val=i)]),
                                     entity_key_serialization_version=3) for i in batch]

    for n in (1, 100):
        feast_t, raw_t = [], []
        for _ in range(repeats):
            batch = list(rng.choice(ids, n, replace=False))
            t0 = time.perf_counter()
            res = store.get_online_features(features=service, entity_rows=[{"doc_id": i} for i in batch]).to_dict()
            feast_t.append(time.perf_counter() - t0)
            assert all(v is not None for v in res["quality_score"])
            t0 = time.perf_counter()
            keys = raw_keys(batch)
            got = db.execute(f"select entity_key, feature_name, value from {table} where entity_key in "
                             f"({','.join('?' * len(keys))})", keys).fetchall()
            raw_t.append(time.perf_counter() - t0)
            assert len({g[0] for g in got}) == n
        out["online"][n] = {"feast_ms": pct(feast_t), "sqlite_ms": pct(raw_t)}

    for n in entity_sizes:
        entity = pd.DataFrame({"doc_id": rng.choice(ids, n, replace=True),
                               "event_timestamp": now - pd.to_timedelta(rng.integers(0, 60 * 86400, n), unit="s")})
        t0 = time.perf_counter()
        got = historical_features(ws, cfg, entity)
        t_feast = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = as_of_pandas(data, entity, ttl=timedelta(days=365))
        t_pandas = time.perf_counter() - t0
        agree = np.allclose(got["quality_score"].to_numpy(dtype=float), ref["quality_score"].to_numpy(dtype=float),
                            equal_nan=True)
        out["historical"][n] = {"feast_s": round(t_feast, 3), "pandas_s": round(t_pandas, 3), "agree": bool(agree)}
    db.close()
    return out


def as_of_pandas(data: pd.DataFrame, entity: pd.DataFrame, *, ttl: timedelta) -> pd.DataFrame:
    """The same point-in-time join with merge_asof: newest event <= t, within the ttl, created <= t."""
    left = entity.reset_index().assign(t=lambda d: pd.to_datetime(d["event_timestamp"], utc=True).astype("datetime64[ns, UTC]"))
    right = data.assign(t=data["event_timestamp"].astype("datetime64[ns, UTC]"),
                        ev=data["event_timestamp"].astype("datetime64[ns, UTC]"),
                        cr=data["created_timestamp"].astype("datetime64[ns, UTC]"))
    right = right.sort_values(["t", "cr"])
    merged = pd.merge_asof(left.sort_values("t"), right[["t", "doc_id", "ev", "cr", "quality_score"]], on="t", by="doc_id",
                           direction="backward")
    stale = (merged["ev"] < merged["t"] - ttl) | (merged["cr"] > merged["t"])
    merged.loc[stale, "quality_score"] = np.nan
    return merged.sort_values("index").reset_index(drop=True)


def clustered(n: int, dim: int, rng: np.random.Generator, centres: np.ndarray) -> np.ndarray:
    """Clustered unit vectors, as embeddings are: a centre plus noise."""
    v = centres[rng.integers(0, len(centres), n)] + 0.6 * rng.normal(size=(n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def bench_vectors(sizes: list[int], queries: int, dim: int, root: Path, *, m: int, ef_construct: int, ef: int) -> dict:
    """The embedded engine as the pipeline runs it (EdgeCollections, the store behind vectors.url unset)."""
    from qdrant_client import models

    from lmforge.components.vectors.edge import EdgeCollections

    rng = np.random.default_rng(1)
    centres = rng.normal(size=(200, dim)).astype(np.float32)
    out: dict = {}
    for n in sizes:
        vecs, qs = clustered(n, dim, rng, centres), clustered(queries, dim, rng, centres)
        store = EdgeCollections(root / f"qdrant-{n}", m=m, ef_construct=ef_construct, hnsw_ef=ef)
        with store.session():   # one hold for the whole run: a bare call would load the shard each time
            store.create_collection("bench", vectors_config=models.VectorParams(size=dim, distance=models.Distance.COSINE))
            t0 = time.perf_counter()
            for s in range(0, n, 2000):
                store.upsert("bench", [models.PointStruct(id=i, vector=vecs[i].tolist()) for i in range(s, min(s + 2000, n))])
            t_up = time.perf_counter() - t0
            t0 = time.perf_counter()
            store.optimize("bench")   # merge the segments and build the HNSW graph, as index_dataset does
            t_index = time.perf_counter() - t0
            q_t, np_t, recall = [], [], []
            for q in qs:
                t0 = time.perf_counter()
                hits = store.query_points("bench", query=q.tolist(), limit=10).points
                q_t.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                sims = vecs @ q
                top = np.argpartition(-sims, 10)[:10]
                top = top[np.argsort(-sims[top])]
                np_t.append(time.perf_counter() - t0)
                recall.append(len({h.id for h in hits} & set(top.tolist())) / 10)
        store.close()
        engine, brute = pct(q_t), pct(np_t)
        out[n] = {"upsert_s": round(t_up, 2), "index_s": round(t_index, 2), "engine_ms": engine, "numpy_ms": brute,
                  "ratio_p50": round(engine[0] / brute[0], 3), "recall_at_10": float(np.mean(recall)),
                  "hnsw": {"m": m, "ef_construct": ef_construct, "ef": ef}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000, help="documents in the offline source (2 versions each)")
    ap.add_argument("--entities", type=int, nargs="+", default=[10_000, 100_000], help="entity rows for get_historical_features")
    ap.add_argument("--parts", nargs="+", choices=["feast", "vectors"], default=["feast", "vectors"])
    ap.add_argument("--points", type=int, nargs="+", default=[10_000, 100_000], help="vector collection sizes")
    ap.add_argument("--repeats", type=int, default=200, help="online lookups per size")
    ap.add_argument("--queries", type=int, default=100, help="Qdrant queries per size")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--m", type=int, default=16, help="HNSW edges per node (vectors.hnsw_m)")
    ap.add_argument("--ef-construct", type=int, default=100, help="HNSW build beam (vectors.hnsw_ef_construct)")
    ap.add_argument("--ef", type=int, default=None, help="HNSW search beam (default: vectors.hnsw_ef)")
    args = ap.parse_args()
    if args.ef is None:
        from lmforge.components.sections.vectors import VectorsConfig

        args.ef = VectorsConfig().hnsw_ef
    load_before = os.getloadavg()[0]
    feast_res: dict = {"online": {}, "historical": {}}
    vector_res: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-features-") as tmp:
        if "feast" in args.parts:
            feast_res = bench_feast(args.rows, args.entities, args.repeats, Path(tmp) / "ws")
        if "vectors" in args.parts:
            vector_res = bench_vectors(args.points, args.queries, args.dim, Path(tmp), m=args.m,
                                       ef_construct=args.ef_construct, ef=args.ef)
    rows = table_rows(feast_res, vector_res)
    # The machine may be shared: a load far above nproc inflates every latency here, baselines included.
    load = (round(load_before, 1), round(os.getloadavg()[0], 1))
    rows.append(("1-min load average, start / end (nproc %d)" % os.cpu_count(), f"{load[0]} / {load[1]}", "", "", ""))
    results = {"feast": feast_res, "vectors": vector_res, "args": vars(args), "loadavg_start_end": load}
    cmd = "python benchmarks/bench_features.py " + " ".join(sys.argv[1:])
    name = "features" if "feast" in args.parts else "vectors"
    notes = (f"Vector index: qdrant-edge-py {metadata.version('qdrant-edge-py')}, HNSW m={args.m}, "
             f"ef_construct={args.ef_construct}, search ef={args.ef}; latency is one query at a time, ratio = p50 / p50."
             if "vectors" in args.parts else "")
    write_results(name, results, ["measure", "value", "baseline", "baseline value", "ratio"], rows, command=cmd.strip(),
                  notes=notes)
    if "feast" in args.parts:
        print(f"Feast apply {feast_res['apply_s']} s, materialise {feast_res['rows']:,} rows {feast_res['materialize_s']} s")
    for n, r in vector_res.items():
        print(f"engine index {n:,} points: upsert {r['upsert_s']} s, HNSW build {r['index_s']} s; "
              f"top-10 p50 {r['engine_ms'][0]:.3f} ms vs numpy {r['numpy_ms'][0]:.2f} ms = {r['ratio_p50']}x, "
              f"recall@10 {r['recall_at_10']:.3f}")


def table_rows(feast_res: dict, vector_res: dict) -> list[tuple[str, str, str, str, str]]:
    rows = []
    for n, r in feast_res["online"].items():
        rows.append((f"Feast get_online_features, {n} entit{'y' if n == 1 else 'ies'} (p50 / p99 ms)",
                     f"{r['feast_ms'][0]:.2f} / {r['feast_ms'][1]:.2f}", "raw sqlite3 SELECT",
                     f"{r['sqlite_ms'][0]:.3f} / {r['sqlite_ms'][1]:.3f}", f"{r['feast_ms'][0] / r['sqlite_ms'][0]:.0f}x"))
    for n, r in feast_res["historical"].items():
        rows.append((f"Feast get_historical_features, {n:,} entity rows (s)", f"{r['feast_s']:.2f}",
                     "pandas merge_asof", f"{r['pandas_s']:.2f}",
                     f"{r['feast_s'] / r['pandas_s']:.1f}x (same values: {r['agree']})"))
    for n, r in vector_res.items():
        rows.append((f"Qdrant embedded engine (HNSW) index build, {n:,} points (s)",
                     f"{r['upsert_s'] + r['index_s']:.1f}", "", "",
                     f"upserts {r['upsert_s']:.1f} s + HNSW graph {r['index_s']:.1f} s"))
        rows.append((f"Qdrant embedded engine search top-10, {n:,} points (p50 / p99 ms)",
                     f"{r['engine_ms'][0]:.2f} / {r['engine_ms'][1]:.2f}", "numpy brute force",
                     f"{r['numpy_ms'][0]:.2f} / {r['numpy_ms'][1]:.2f}",
                     f"{r['ratio_p50']:.2f}x, recall@10 {r['recall_at_10']:.3f}"))
    return rows


if __name__ == "__main__":
    main()
