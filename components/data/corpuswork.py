"""The corpus-wide steps of the data stage, between the per-shard ones of shardwork.py.

    sel = select(ingest_refs, cfg, out / "select")                # sampling, duplicate ids, exact duplicates
    near = near_dedup(ingest_refs, sel, cfg.dedup, out / "near")  # MinHash LSH over every shard's signatures
    spl = assign_split(ingest_refs, sel, near, cfg.split, out / "split", seed=cfg.seed)
    tok = train_tokenizer_from(ingest_refs, sel, near, spl, cfg.tokenizer, out / "tokenizer")
    tok = copy_base_tokenizer(Path(base), out / "tokenizer")    # training.model.init set: the base's own tokenizer
    manifest = assemble(dataset_root, sel=sel, records_refs=..., finish_refs=..., ...)   # datasets/<version>

Each step takes the typed references of the steps before it and returns its own
(components/data/stepref.py: SelectRef, NearRef, SplitRef, TokenizerRef).

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
from lmforge.components.data.shardwork import QUARANTINE, ROWS, SIG, kept_rows, load_mask, quarantined_row, sample_key
from lmforge.components.data.split import SPLITS, place_groups
from lmforge.components.data.stepref import FinishRef, IngestRef, NearRef, RecordsRef, SelectRef, SplitRef, TokenizerRef
from lmforge.components.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from lmforge.components.errors import UserError
from lmforge.components.model.basemodel import copy_tokenizer, tokenizer_hash
from lmforge.components.sections.data import DataConfig, DedupConfig, SplitConfig, TokenizerConfig
from lmforge.components.workspace import MANIFEST, atomic_dir, atomic_write_json, sha256_file, sha256_tree

DATASET_PARTS = ["records/train.jsonl", "records/validation.jsonl", "records/test.jsonl", "quarantine.jsonl",
                 "features.parquet", "tokenizer", "shards"]


def _sample_threshold(ingest_refs: list[IngestRef], cfg: DataConfig) -> int | None:
    """The largest sample key kept when max_docs samples the records (None: keep all)."""
    total = sum(r.records_read for r in ingest_refs)
    if cfg.max_docs is None or total <= cfg.max_docs:
        return None
    keys = [pq.read_table(r.path(ROWS), columns=["sample_key"]).column("sample_key").to_numpy() for r in ingest_refs]
    keys += [np.array([sample_key(cfg.seed, q.origin) for q in iter_quarantine(r.path(QUARANTINE))], dtype=np.uint64)
             for r in ingest_refs]
    allk = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
    return int(np.partition(allk, cfg.max_docs - 1)[cfg.max_docs - 1])


def _hash128(values: list[str]) -> np.ndarray:
    """(n, 2) uint64: two keyed SipHashes of each string (pandas' vectorised hash); equal strings, equal rows."""
    from pandas.util import hash_array

    arr = np.asarray(values, dtype=object)
    if not len(arr):
        return np.zeros((0, 2), np.uint64)
    return np.stack([hash_array(arr, hash_key=k, categorize=False) for k in ("lmforge-select-1", "lmforge-select-2")], 1)


def first_occurrences(keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """For `rows` (indices into `keys`, in corpus order): the first of those rows that has the same key."""
    if not len(rows):
        return rows
    k = keys[rows]
    order = np.lexsort((rows, k[:, 1], k[:, 0]))  # by key, then corpus order
    sk = k[order]
    starts = np.ones(len(order), bool)
    starts[1:] = (sk[1:] != sk[:-1]).any(axis=1)
    group_start = np.maximum.accumulate(np.where(starts, np.arange(len(order)), 0))
    first = np.empty(len(rows), dtype=rows.dtype)
    first[order] = rows[order[group_start]]
    return first


def select(ingest_refs: list[IngestRef], cfg: DataConfig, out: Path) -> SelectRef:
    """Per shard, which rows go on (`unique-<i>.npy`), and the quarantine entries that stay (after sampling).

    In corpus order: a record whose id an earlier sampled record already used is quarantined
    (`duplicate_id`); among the rest, the first record with a given text is unique and later
    ones are exact duplicates. Both are sorts over fixed-width columns of the whole corpus
    (128-bit hashes of ids and texts, ~40 bytes a record), not Python dicts of its strings.
    """
    cut = _sample_threshold(ingest_refs, cfg)
    id_keys, text_keys, samples, shard_starts = [], [], [], [0]
    for r in ingest_refs:
        t = pq.read_table(r.path(ROWS), columns=["id", "sample_key", "text_hash"])
        id_keys.append(_hash128(t.column("id").to_pylist()))
        text_keys.append(np.frombuffer(b"".join(t.column("text_hash").to_pylist()), dtype=np.uint64).reshape(-1, 2))
        samples.append(np.ones(t.num_rows, bool) if cut is None else t.column("sample_key").to_numpy() <= cut)
        shard_starts.append(shard_starts[-1] + t.num_rows)
    ids = np.concatenate(id_keys) if id_keys else np.zeros((0, 2), np.uint64)
    texts = np.concatenate(text_keys) if text_keys else np.zeros((0, 2), np.uint64)
    sampled = np.flatnonzero(np.concatenate(samples)) if samples else np.zeros(0, np.int64)
    id_first = first_occurrences(ids, sampled)
    dup_id, used_by = sampled[id_first != sampled], id_first[id_first != sampled]
    go_on = sampled[id_first == sampled]
    text_first = first_occurrences(texts, go_on)
    unique = go_on[text_first == go_on]
    onto = np.bincount(text_first[text_first != go_on], minlength=len(ids)).astype(np.int64)
    n = {"sampled_out": int(len(ids) - len(sampled)), "clean": int(len(go_on)),
         "exact_duplicates": int(len(go_on) - len(unique)), "quarantined": 0}
    starts = np.asarray(shard_starts, dtype=np.int64)
    origin_of = _origins(ingest_refs, starts, used_by)
    reasons: Counter[str] = Counter()
    with atomic_dir(out) as tmp:
        kept_q, dup_entries = [], []
        for k, r in enumerate(ingest_refs):
            i, lo, hi = r.index, starts[k], starts[k + 1]
            mask = np.zeros(hi - lo, bool)
            mask[unique[(unique >= lo) & (unique < hi)] - lo] = True
            np.save(tmp / f"unique-{i:05d}.npy", mask)
            # exact duplicates collapsed onto each unique row, in the order of that shard's unique rows
            np.save(tmp / f"exact-{i:05d}.npy", onto[lo:hi][mask])
            here = (dup_id >= lo) & (dup_id < hi)
            if here.any():
                rows = (dup_id[here] - lo).tolist()
                full = pq.read_table(r.path(ROWS)).take(rows).to_pylist()
                dup_entries += [quarantined_row(row, "duplicate_id", f"id {row['id']!r} already used by {origin_of[int(g)]}")
                                for row, g in zip(full, used_by[here])]
            for q in iter_quarantine(r.path(QUARANTINE)):
                if cut is None or sample_key(cfg.seed, q.origin) <= cut:
                    kept_q.append(q)
                    reasons[q.reason] += 1
                else:
                    n["sampled_out"] += 1
        for q in dup_entries:
            reasons[q.reason] += 1
        n["quarantined"] = write_quarantine(tmp / QUARANTINE, [*kept_q, *dup_entries])
    records_read = sum(r.records_read for r in ingest_refs)
    docs_in = records_read - n["sampled_out"]
    if docs_in != n["clean"] + n["quarantined"]:
        raise AssertionError(f"records do not reconcile: {records_read} read - {n['sampled_out']} sampled out = {docs_in}, "
                             f"but {n['clean']} clean + {n['quarantined']} quarantined")
    if n["clean"] == 0:
        raise UserError("data.source", cfg.source or "builtin", "left no records after validation",
                        "Look at quarantine.jsonl in the build folder for the reasons, and fix the input")
    files = [QUARANTINE, *(f"{k}-{r.index:05d}.npy" for r in ingest_refs for k in ("unique", "exact"))]
    return SelectRef.of(out, files, records_read=records_read, docs_in=docs_in, **n,
                        quarantined_by_reason=dict(sorted(reasons.items())))


def _origins(ingest_refs: list[IngestRef], starts: np.ndarray, rows: np.ndarray) -> dict[int, str]:
    """{global row: its origin} for a few rows (those a duplicate id points back to)."""
    out: dict[int, str] = {}
    wanted = np.unique(rows)
    for k, r in enumerate(ingest_refs):
        here = wanted[(wanted >= starts[k]) & (wanted < starts[k + 1])]
        if len(here):
            origins = pq.read_table(r.path(ROWS), columns=["origin"]).column("origin").take(here - starts[k])
            out.update(zip(here.tolist(), origins.to_pylist()))
    return out


def near_dedup(ingest_refs: list[IngestRef], sel: SelectRef, cfg: DedupConfig, out: Path) -> NearRef:
    """Per shard, which unique rows are kept (`keep-<i>.npy`) and each kept row's cluster size (`cluster-<i>.npy`).

    Documents are the rows select marked unique, in corpus order; their signatures stay memory-mapped and only
    those whose band key collides are read.
    """
    rows = [np.flatnonzero(load_mask(sel, "unique", r.index)) for r in ingest_refs]
    starts = np.concatenate([[0], np.cumsum([len(u) for u in rows])]).astype(np.int64)
    bands, band_rows = lsh_params(cfg.threshold, cfg.num_perm)
    dup_of: dict[int, int] = {}
    if cfg.enabled and starts[-1]:
        sigs = [np.load(r.path(SIG), mmap_mode="r") for r in ingest_refs]
        if any(s.shape[1] != cfg.num_perm for s in sigs):
            raise AssertionError(f"ingest signatures have {sigs[0].shape[1]} slots, dedup.num_perm is {cfg.num_perm}")
        keys = np.concatenate([band_keys(np.asarray(s[u]), bands=bands, rows=band_rows) for s, u in zip(sigs, rows)])

        def load_sig(idx: np.ndarray) -> np.ndarray:
            shard = np.searchsorted(starts, idx, side="right") - 1
            return np.stack([sigs[s][rows[s][i - starts[s]]] for s, i in zip(shard.tolist(), idx.tolist())])

        dup_of = greedy_near_dups(keys, load_sig, threshold=cfg.threshold, num_perm=cfg.num_perm)
    exact = np.concatenate([load_mask(sel, "exact", r.index) for r in ingest_refs]) if ingest_refs \
        else np.zeros(0, np.int64)
    cluster = exact + 1
    for j, target in dup_of.items():
        cluster[target] += cluster[j]
    keep = np.ones(int(starts[-1]), bool)
    keep[list(dup_of)] = False
    examples = [{"removed": int(j), "kept": int(i)} for j, i in list(dup_of.items())[:20]]
    with atomic_dir(out) as tmp:
        for r, lo, hi in zip(ingest_refs, starts[:-1], starts[1:]):
            np.save(tmp / f"keep-{r.index:05d}.npy", keep[lo:hi])
            np.save(tmp / f"cluster-{r.index:05d}.npy", cluster[lo:hi])
    files = [f"{k}-{r.index:05d}.npy" for r in ingest_refs for k in ("keep", "cluster")]
    return NearRef.of(out, files, near_duplicates=len(dup_of), kept=int(keep.sum()), lsh={"bands": bands, "rows": band_rows},
                      examples=examples)


def assign_split(ingest_refs: list[IngestRef], sel: SelectRef, near: NearRef, cfg: SplitConfig,
                 out: Path, *, seed: int) -> SplitRef:
    """split.json: the groups placed outside train (train is the default) and the corpus's newest time."""
    sizes: Counter[str] = Counter()
    newest = 0.0
    for r in ingest_refs:
        t = kept_rows(r, sel, near, ["module", "mtime"])
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
    return SplitRef.of(out, ["split.json"], counts={s: counts.get(s, 0) for s in SPLITS},
                       groups={s: groups.get(s, 0) for s in SPLITS})


def train_tokenizer_from(ingest_refs: list[IngestRef], sel: SelectRef, near: NearRef, spl: SplitRef,
                         cfg: TokenizerConfig, out: Path) -> TokenizerRef:
    """A BPE tokenizer trained on kept train-split text, streamed shard by shard, up to cfg.train_chars characters."""
    places = json.loads(spl.path("split.json").read_text())["places"]
    used = {"docs": 0, "chars": 0}

    def texts():
        for r in ingest_refs:
            t = kept_rows(r, sel, near, ["text", "module"])
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
    return TokenizerRef.of(out, ["tokenizer.json"], sha256=sha256_tree(out / "tokenizer.json"), vocab_size=tok.get_vocab_size(),
                           trained_on=used)


def copy_base_tokenizer(base: Path, out: Path) -> TokenizerRef:
    """A base model's own tokenizer instead of a trained one: its files copied as they are (components/model/basemodel.py).

    The reference's hash is the base's tokenizer hash, so the dataset version depends on it and
    training can check that a dataset was made with its base's tokenizer. Nothing is trained on.
    """
    with atomic_dir(out) as tmp:
        files = copy_tokenizer(Path(base), tmp)
    return TokenizerRef.of(out, files, sha256=tokenizer_hash(out), vocab_size=load_tokenizer(out).get_vocab_size(),
                           trained_on={"docs": 0, "chars": 0})


def _write_shards(dst: Path, finish_refs: list[FinishRef], vocab_size: int) -> dict[str, Any]:
    """shards/: <split>.bin (every shard's tokens, in order), <split>.offsets.npy and index.json."""
    from lmforge.components.data.shards import INDEX, dtype_for

    dtype = dtype_for(vocab_size)
    dst.mkdir(parents=True)
    index: dict[str, Any] = {"dtype": dtype.name, "vocab_size": vocab_size, "splits": {}}
    for s in SPLITS:
        offsets, n = [], 0
        with open(dst / f"{s}.bin", "wb") as f:
            for r in finish_refs:
                tokens = np.load(r.path(f"tokens-{s}.npy"))
                lengths = np.load(r.path(f"lengths-{s}.npy"))
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


def assemble(dataset_root: Path, *, sel: SelectRef, records_refs: list[RecordsRef], finish_refs: list[FinishRef],
             tokenizer: TokenizerRef, counts: dict[str, Any], config_hash: str, source: dict[str, Any],
             report: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """Build the dataset's parts in `scratch`, hash them, then rename datasets/<version> into place.

    When a dataset with the same version already exists it is left as it is: same version, same content.
    """
    import pyarrow as pa

    with atomic_dir(Path(scratch)) as tmp:
        (tmp / "records").mkdir()
        for s in SPLITS:
            _concat(tmp / "records" / f"{s}.jsonl", [r.path(f"records-{s}.jsonl") for r in records_refs])
        shutil.copyfile(sel.path(QUARANTINE), tmp / "quarantine.jsonl")
        writer = None
        for r in records_refs:
            t = pq.read_table(r.path("features.parquet"))
            writer = writer or pq.ParquetWriter(tmp / "features.parquet", t.schema)
            writer.write_table(t)
        if writer is None:
            from lmforge.components.data.featurize import SCHEMA

            pq.write_table(pa.table({f.name: [] for f in SCHEMA}, schema=SCHEMA), tmp / "features.parquet")
        else:
            writer.close()
        shutil.copytree(tokenizer.dir, tmp / "tokenizer")
        _write_shards(tmp / "shards", finish_refs, tokenizer.vocab_size)
    scratch = Path(scratch)
    hashes = {p: sha256_tree(scratch / p) for p in DATASET_PARTS}
    manifest = build_manifest(counts=counts, hashes=hashes, config_hash=config_hash, tokenizer_hash=tokenizer.sha256,
                              vocab_size=tokenizer.vocab_size, source=source)
    final = Path(dataset_root) / manifest["version"]
    if (final / MANIFEST).is_file():
        shutil.rmtree(scratch, ignore_errors=True)
        return json.loads((final / MANIFEST).read_text())
    atomic_write_json(scratch / "report.json", {**report, "version": manifest["version"]})
    atomic_write_json(scratch / MANIFEST, manifest)  # last: a folder with a manifest is complete
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch.rename(final)
    return manifest
