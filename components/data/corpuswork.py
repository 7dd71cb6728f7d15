"""The corpus-wide steps of the data stage, between the per-shard ones of shardwork.py.

    sel = select(ingest_refs, cfg, out / "select")                # sampling, duplicate ids, exact duplicates
    near = near_dedup(ingest_refs, sel, cfg.dedup, out / "near")  # MinHash LSH over every shard's signatures
    spl = assign_split(ingest_refs, sel, near, cfg.split, out / "split", seed=cfg.seed)
    tok = train_tokenizer_from(ingest_refs, sel, near, spl, cfg.tokenizer, out / "tokenizer")
    manifest = assemble(dataset_root, ...)                       # datasets/<version>, streamed together

Each reads only small columns of every shard (signatures, hashes, group names), never the
documents' text, except the tokenizer, which streams kept train text up to
`tokenizer.train_chars` characters. Decisions go back to the shards as per-shard
masks (`<name>-<index>.npy`) in the step's folder. Corpus order is (shard, row).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from lmforge.components.data.manifest import build_manifest
from lmforge.components.data.minhash import band_keys, greedy_near_dups, lsh_params
from lmforge.components.data.quarantine import iter_quarantine, write_quarantine
from lmforge.components.data.shardwork import QUARANTINE, ROWS, SIG, kept_rows, load_mask, quarantined_row, ref, sample_key
from lmforge.components.data.split import SPLITS, place_groups
from lmforge.components.data.tokenizer import save_tokenizer, train_tokenizer
from lmforge.components.errors import UserError
from lmforge.components.sections.data import DataConfig, DedupConfig, SplitConfig, TokenizerConfig
from lmforge.components.workspace import atomic_dir, atomic_write_json, sha256_file, sha256_tree

DATASET_PARTS = ["records/train.jsonl", "records/validation.jsonl", "records/test.jsonl", "quarantine.jsonl",
                 "features.parquet", "tokenizer", "shards"]


def _sample_threshold(ingest_refs: list[dict[str, Any]], cfg: DataConfig) -> int | None:
    """The largest sample key kept when max_docs samples the records (None: keep all)."""
    total = sum(r["records_read"] for r in ingest_refs)
    if cfg.max_docs is None or total <= cfg.max_docs:
        return None
    keys = [pq.read_table(Path(r["dir"]) / ROWS, columns=["sample_key"]).column("sample_key").to_numpy() for r in ingest_refs]
    keys += [np.array([sample_key(cfg.seed, q.origin) for q in iter_quarantine(Path(r["dir"]) / QUARANTINE)], dtype=np.uint64)
             for r in ingest_refs]
    allk = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
    return int(np.partition(allk, cfg.max_docs - 1)[cfg.max_docs - 1])


def select(ingest_refs: list[dict[str, Any]], cfg: DataConfig, out: Path) -> dict[str, Any]:
    """Per shard, which rows go on (`unique-<i>.npy`), and the quarantine entries that stay (after sampling)."""
    cut = _sample_threshold(ingest_refs, cfg)
    seen_ids: dict[str, str] = {}
    seen_text: dict[bytes, tuple[int, int]] = {}
    exact_onto: dict[tuple[int, int], int] = {}
    dup_entries, n = [], {"sampled_out": 0, "clean": 0, "exact_duplicates": 0, "quarantined": 0}
    reasons: Counter[str] = Counter()
    with atomic_dir(out) as tmp:
        kept_q = []
        for r in ingest_refs:
            i = r["index"]
            t = pq.read_table(Path(r["dir"]) / ROWS, columns=["id", "origin", "sample_key", "text_hash"])
            ids, origins, hashes = t.column("id").to_pylist(), t.column("origin").to_pylist(), t.column("text_hash").to_pylist()
            in_sample = np.ones(t.num_rows, bool) if cut is None else t.column("sample_key").to_numpy() <= cut
            unique = np.zeros(t.num_rows, bool)
            dup_rows = []
            for row in np.flatnonzero(in_sample).tolist():
                if ids[row] in seen_ids:
                    dup_rows.append((row, f"id {ids[row]!r} already used by {seen_ids[ids[row]]}"))
                    continue
                seen_ids[ids[row]] = origins[row]
                first = seen_text.setdefault(hashes[row], (i, row))
                if first == (i, row):
                    unique[row] = True
                else:
                    exact_onto[first] = exact_onto.get(first, 0) + 1
                    n["exact_duplicates"] += 1
            if dup_rows:
                full = pq.read_table(Path(r["dir"]) / ROWS).take([row for row, _ in dup_rows]).to_pylist()
                dup_entries += [quarantined_row(row, "duplicate_id", why) for row, (_, why) in zip(full, dup_rows)]
            n["sampled_out"] += int(t.num_rows - in_sample.sum())
            n["clean"] += int(in_sample.sum()) - len(dup_rows)
            np.save(tmp / f"unique-{i:05d}.npy", unique)
            for q in iter_quarantine(Path(r["dir"]) / QUARANTINE):
                if cut is None or sample_key(cfg.seed, q.origin) <= cut:
                    kept_q.append(q)
                    reasons[q.reason] += 1
                else:
                    n["sampled_out"] += 1
        for q in dup_entries:
            reasons[q.reason] += 1
        n["quarantined"] = write_quarantine(tmp / QUARANTINE, [*kept_q, *dup_entries])
        # exact duplicates collapsed onto each unique row, in the order of that shard's unique rows
        for r in ingest_refs:
            i = r["index"]
            unique = np.load(tmp / f"unique-{i:05d}.npy")
            onto = np.array([exact_onto.get((i, row), 0) for row in np.flatnonzero(unique).tolist()], dtype=np.int64)
            np.save(tmp / f"exact-{i:05d}.npy", onto)
    records_read = sum(r["records_read"] for r in ingest_refs)
    docs_in = records_read - n["sampled_out"]
    if docs_in != n["clean"] + n["quarantined"]:
        raise AssertionError(f"records do not reconcile: {records_read} read - {n['sampled_out']} sampled out = {docs_in}, "
                             f"but {n['clean']} clean + {n['quarantined']} quarantined")
    if n["clean"] == 0:
        raise UserError("data.source", cfg.source or "builtin", "left no records after validation",
                        "Look at quarantine.jsonl in the build folder for the reasons, and fix the input")
    files = [QUARANTINE, *(f"{k}-{r['index']:05d}.npy" for r in ingest_refs for k in ("unique", "exact"))]
    return ref(out, files, records_read=records_read, docs_in=docs_in, **n,
               quarantined_by_reason=dict(sorted(reasons.items())))


def near_dedup(ingest_refs: list[dict[str, Any]], sel: dict[str, Any], cfg: DedupConfig, out: Path) -> dict[str, Any]:
    """Per shard, which unique rows are kept (`keep-<i>.npy`) and each kept row's cluster size (`cluster-<i>.npy`).

    Documents are the rows select marked unique, in corpus order; their signatures stay memory-mapped and only
    those whose band key collides are read.
    """
    rows = [np.flatnonzero(load_mask(sel["dir"], "unique", r["index"])) for r in ingest_refs]
    starts = np.concatenate([[0], np.cumsum([len(u) for u in rows])]).astype(np.int64)
    bands, band_rows = lsh_params(cfg.threshold, cfg.num_perm)
    dup_of: dict[int, int] = {}
    if cfg.enabled and starts[-1]:
        sigs = [np.load(Path(r["dir"]) / SIG, mmap_mode="r") for r in ingest_refs]
        if any(s.shape[1] != cfg.num_perm for s in sigs):
            raise AssertionError(f"ingest signatures have {sigs[0].shape[1]} slots, dedup.num_perm is {cfg.num_perm}")
        keys = np.concatenate([band_keys(np.asarray(s[u]), bands=bands, rows=band_rows) for s, u in zip(sigs, rows)])

        def load_sig(idx: np.ndarray) -> np.ndarray:
            shard = np.searchsorted(starts, idx, side="right") - 1
            return np.stack([sigs[s][rows[s][i - starts[s]]] for s, i in zip(shard.tolist(), idx.tolist())])

        dup_of = greedy_near_dups(keys, load_sig, threshold=cfg.threshold, num_perm=cfg.num_perm)
    exact = np.concatenate([load_mask(sel["dir"], "exact", r["index"]) for r in ingest_refs]) if ingest_refs \
        else np.zeros(0, np.int64)
    cluster = exact + 1
    for j, target in dup_of.items():
        cluster[target] += cluster[j]
    keep = np.ones(int(starts[-1]), bool)
    keep[list(dup_of)] = False
    examples = [{"removed": int(j), "kept": int(i)} for j, i in list(dup_of.items())[:20]]
    with atomic_dir(out) as tmp:
        for r, lo, hi in zip(ingest_refs, starts[:-1], starts[1:]):
            np.save(tmp / f"keep-{r['index']:05d}.npy", keep[lo:hi])
            np.save(tmp / f"cluster-{r['index']:05d}.npy", cluster[lo:hi])
    files = [f"{k}-{r['index']:05d}.npy" for r in ingest_refs for k in ("keep", "cluster")]
    return ref(out, files, near_duplicates=len(dup_of), kept=int(keep.sum()), lsh={"bands": bands, "rows": band_rows},
               examples=examples)


def assign_split(ingest_refs: list[dict[str, Any]], sel: dict[str, Any], near: dict[str, Any], cfg: SplitConfig,
                 out: Path, *, seed: int) -> dict[str, Any]:
    """split.json: the groups placed outside train (train is the default) and the corpus's newest time."""
    sizes: Counter[str] = Counter()
    newest = 0.0
    for r in ingest_refs:
        t = kept_rows(r["dir"], sel["dir"], near["dir"], r["index"], ["module", "mtime"])
        sizes.update(t.column("module").to_pylist())
        if t.num_rows:
            newest = max(newest, float(np.max(t.column("mtime").to_numpy())))
    place = place_groups(sizes, cfg, seed=seed)
    counts = Counter[str]()
    for g, s in place.items():
        counts[s] += sizes[g]
    with atomic_dir(out) as tmp:
        atomic_write_json(tmp / "split.json", {"places": {g: s for g, s in sorted(place.items()) if s != "train"},
                                               "created": newest})
    groups = Counter(place.values())
    return ref(out, ["split.json"], counts={s: counts.get(s, 0) for s in SPLITS}, groups={s: groups.get(s, 0) for s in SPLITS})


def train_tokenizer_from(ingest_refs: list[dict[str, Any]], sel: dict[str, Any], near: dict[str, Any],
                         spl: dict[str, Any], cfg: TokenizerConfig, out: Path) -> dict[str, Any]:
    """A BPE tokenizer trained on kept train-split text, streamed shard by shard, up to cfg.train_chars characters."""
    places = json.loads((Path(spl["dir"]) / "split.json").read_text())["places"]
    used = {"docs": 0, "chars": 0}

    def texts():
        for r in ingest_refs:
            t = kept_rows(r["dir"], sel["dir"], near["dir"], r["index"], ["text", "module"])
            for text, module in zip(t.column("text").to_pylist(), t.column("module").to_pylist()):
                if places.get(module, "train") != "train":
                    continue
                if cfg.train_chars is not None and used["chars"] >= cfg.train_chars:
                    return
                used["docs"] += 1
                used["chars"] += len(text)
                yield text

    tok = train_tokenizer(texts(), cfg)
    with atomic_dir(out) as tmp:
        save_tokenizer(tok, tmp)
    return {"dir": str(out), "files": {"tokenizer.json": sha256_file(out / "tokenizer.json")},
            "sha256": sha256_tree(out / "tokenizer.json"), "vocab_size": tok.get_vocab_size(), "trained_on": used}


def _write_shards(dst: Path, finish_refs: list[dict[str, Any]], vocab_size: int) -> dict[str, Any]:
    """shards/: <split>.bin (every shard's tokens, in order), <split>.offsets.npy and index.json."""
    from lmforge.components.data.shards import INDEX, dtype_for

    dtype = dtype_for(vocab_size)
    dst.mkdir(parents=True)
    index: dict[str, Any] = {"dtype": dtype.name, "vocab_size": vocab_size, "splits": {}}
    for s in SPLITS:
        offsets, n = [], 0
        with open(dst / f"{s}.bin", "wb") as f:
            for r in finish_refs:
                tokens = np.load(Path(r["dir"]) / f"tokens-{s}.npy")
                lengths = np.load(Path(r["dir"]) / f"lengths-{s}.npy")
                assert tokens.dtype == dtype
                offsets.append(n + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else
                               np.zeros(0, np.int64))
                f.write(tokens.tobytes())
                n += int(len(tokens))
        np.save(dst / f"{s}.offsets.npy", np.concatenate(offsets) if offsets else np.zeros(0, np.int64))
        index["splits"][s] = {"tokens": n, "docs": int(sum(len(o) for o in offsets)), "sha256": sha256_file(dst / f"{s}.bin")}
    atomic_write_json(dst / INDEX, index)
    return index


def _concat(dst: Path, parts: list[Path]) -> None:
    with open(dst, "wb") as f:
        for p in parts:
            with open(p, "rb") as g:
                shutil.copyfileobj(g, f, 1 << 20)


def assemble(dataset_root: Path, *, sel: dict[str, Any], finish_refs: list[dict[str, Any]], tokenizer: dict[str, Any],
             counts: dict[str, Any], config_hash: str, source: dict[str, Any],
             report: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """Build the dataset's parts in `scratch`, hash them, then rename datasets/<version> into place.

    When a dataset with the same version already exists it is left as it is: same version, same content.
    """
    import pyarrow as pa

    with atomic_dir(Path(scratch)) as tmp:
        (tmp / "records").mkdir()
        for s in SPLITS:
            _concat(tmp / "records" / f"{s}.jsonl", [Path(r["dir"]) / f"records-{s}.jsonl" for r in finish_refs])
        shutil.copyfile(Path(sel["dir"]) / QUARANTINE, tmp / "quarantine.jsonl")
        writer = None
        for r in finish_refs:
            t = pq.read_table(Path(r["dir"]) / "features.parquet")
            writer = writer or pq.ParquetWriter(tmp / "features.parquet", t.schema)
            writer.write_table(t)
        if writer is None:
            from lmforge.components.data.featurize import SCHEMA

            pq.write_table(pa.table({f.name: [] for f in SCHEMA}, schema=SCHEMA), tmp / "features.parquet")
        else:
            writer.close()
        shutil.copytree(tokenizer["dir"], tmp / "tokenizer")
        _write_shards(tmp / "shards", finish_refs, tokenizer["vocab_size"])
    scratch = Path(scratch)
    hashes = {p: sha256_tree(scratch / p) for p in DATASET_PARTS}
    manifest = build_manifest(counts=counts, hashes=hashes, config_hash=config_hash, tokenizer_hash=tokenizer["sha256"],
                              vocab_size=tokenizer["vocab_size"], source=source)
    final = Path(dataset_root) / manifest["version"]
    if (final / "manifest.json").is_file():
        shutil.rmtree(scratch, ignore_errors=True)
        return json.loads((final / "manifest.json").read_text())
    atomic_write_json(scratch / "report.json", {**report, "version": manifest["version"]})
    atomic_write_json(scratch / "manifest.json", manifest)  # last: a folder with a manifest is complete
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch.rename(final)
    return manifest
