"""The per-shard steps of the data stage: each reads one shard's files and writes its own folder.

    ing = ingest_shard(spec, cfg, out / "ingest-0003")                 # spec: from readers.plan_shards
    sig = signature_shard(ing["dir"], sel["dir"], 3, cfg.dedup, out / "sig-0003")
    fin = finish_shard(ing["dir"], sel["dir"], near["dir"], spl["dir"], 3, out / "finish-0003")
    enc = encode_shard(fin["dir"], tok["dir"], out / "encode-0003")

Every function returns a small reference: {"dir", "files": {name: sha256}, ...counts}. A shard
holds its documents as Parquet (Arrow record batches); memory grows with the shard, not the
corpus. The global decisions between them (sampling, duplicate ids, exact and near
duplicates, the split) are made by components/data/corpuswork.py from small per-shard
columns and handed back as per-shard masks.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lmforge.components.data.clean import EMPTIED, clean_record
from lmforge.components.data.featurize import document_features
from lmforge.components.data.minhash import band_keys, lsh_params, signatures
from lmforge.components.data.quarantine import Quarantined, quarantine_entry, write_quarantine
from lmforge.components.data.readers import read_shard
from lmforge.components.data.records import FIELDS
from lmforge.components.data.split import SPLITS
from lmforge.components.data.tokenizer import EOS, load_tokenizer
from lmforge.components.data.validate import judge
from lmforge.components.sections.data import DataConfig, DedupConfig
from lmforge.components.workspace import atomic_dir, sha256_file

ROWS = "rows.parquet"
QUARANTINE = "quarantine.jsonl"
ROW_SCHEMA = pa.schema([*((f, pa.string()) for f in FIELDS), ("origin", pa.string()), ("mtime", pa.float64()),
                        ("sample_key", pa.uint64()), ("text_hash", pa.binary(16)), ("qsource", pa.string()),
                        ("qline", pa.int64()), ("qformat", pa.string()), ("qmeta", pa.string()), ("raw", pa.large_binary())])


def sample_key(seed: int, origin: str) -> int:
    """Where a record falls in the seeded sample order: the same for a record in any shard or run."""
    return int.from_bytes(hashlib.sha256(f"{seed}\x1f{origin}".encode("utf-8", "surrogatepass")).digest()[:8], "little")


def ref(out: Path, files: list[str], **extra: Any) -> dict[str, Any]:
    return {"dir": str(out), "files": {f: sha256_file(Path(out) / f) for f in files}, **extra}


def ingest_shard(spec: dict[str, Any], cfg: DataConfig, out: Path) -> dict[str, Any]:
    """Read, validate and clean one input shard: rows.parquet (clean records + their raw) and quarantine.jsonl."""
    tally: dict[str, Any] = {}
    cols: dict[str, list[Any]] = {name: [] for name in ROW_SCHEMA.names}
    bad: list[Quarantined] = []
    for item in read_shard(spec, cfg, tally):
        judged = judge(item, cfg.validation)
        if isinstance(judged, Quarantined):
            bad.append(judged)
            continue
        r = clean_record(judged)
        if not (r.docstring and r.text):
            bad.append(quarantine_entry(item, "empty", EMPTIED))
            continue
        for f in FIELDS:
            cols[f].append(getattr(r, f))
        cols["origin"].append(item.origin)
        cols["mtime"].append(item.mtime)
        cols["sample_key"].append(sample_key(cfg.seed, item.origin))
        cols["text_hash"].append(hashlib.sha256(r.text.encode("utf-8")).digest()[:16])
        cols["qsource"].append(item.source)
        cols["qline"].append(item.line)
        cols["qformat"].append(item.format)
        cols["qmeta"].append(json.dumps(item.meta, sort_keys=True) if item.meta else "")
        cols["raw"].append(item.raw)
    table = pa.table(cols, schema=ROW_SCHEMA)
    with atomic_dir(out) as tmp:
        pq.write_table(table, tmp / ROWS, row_group_size=4096)
        n_bad = write_quarantine(tmp / QUARANTINE, bad)
    reasons: dict[str, int] = {}
    for q in bad:
        reasons[q.reason] = reasons.get(q.reason, 0) + 1
    return ref(out, [ROWS, QUARANTINE], index=spec["index"], records_read=tally["records_read"], rows=table.num_rows,
               quarantined=n_bad, quarantined_by_reason=dict(sorted(reasons.items())), files_read=tally.get("files", 0))


def quarantined_row(row: dict[str, Any], reason: str, detail: str) -> Quarantined:
    """The quarantine entry of a clean row judged bad later (a duplicate id), from the raw it carries."""
    from lmforge.components.data.quarantine import encode_raw

    return Quarantined(origin=row["origin"], reason=reason, detail=detail, source=row["qsource"], line=row["qline"],
                       format=row["qformat"], meta=json.loads(row["qmeta"]) if row["qmeta"] else {}, **encode_raw(row["raw"]))


def load_mask(select_dir: str, name: str, index: int) -> np.ndarray:
    return np.load(Path(select_dir) / f"{name}-{index:05d}.npy")


def signature_shard(ingest_dir: str, select_dir: str, index: int, cfg: DedupConfig, out: Path) -> dict[str, Any]:
    """MinHash signatures and LSH band keys of the shard's rows that survived select (unique, sampled)."""
    keep = load_mask(select_dir, "unique", index)
    texts = pq.read_table(Path(ingest_dir) / ROWS, columns=["text"]).column("text").combine_chunks()
    texts = texts.filter(pa.array(keep)) if len(keep) else texts
    sig = signatures(texts, num_perm=cfg.num_perm, shingle=cfg.shingle)
    bands, rows = lsh_params(cfg.threshold, cfg.num_perm)
    with atomic_dir(out) as tmp:
        np.save(tmp / "sig.npy", sig)
        np.save(tmp / "keys.npy", band_keys(sig, bands=bands, rows=rows))
    return ref(out, ["sig.npy", "keys.npy"], index=index, docs=len(sig), bands=bands, rows=rows)


def finish_shard(ingest_dir: str, select_dir: str, near_dir: str, split_dir: str, index: int, out: Path) -> dict[str, Any]:
    """The shard's kept documents with their split: docs.parquet, records-<split>.jsonl, features.parquet."""
    table = pq.read_table(Path(ingest_dir) / ROWS, columns=[*FIELDS, "origin", "mtime"])
    unique = load_mask(select_dir, "unique", index)
    table = table.filter(pa.array(unique)) if table.num_rows else table
    keep = load_mask(near_dir, "keep", index)
    sizes = load_mask(near_dir, "cluster", index)
    table = table.filter(pa.array(keep)) if table.num_rows else table
    sizes = sizes[keep] if len(keep) else sizes
    split_info = json.loads((Path(split_dir) / "split.json").read_text())
    places = split_info["places"]  # only the groups that are not in train
    modules = table.column("module").to_pylist()
    split = [places.get(m, "train") for m in modules]
    docs = table.append_column("split", pa.array(split, pa.string())).append_column("cluster_size", pa.array(sizes, pa.int64()))
    feats = document_features(docs.column("id").to_pylist(), docs.column("text").combine_chunks(), splits=split,
                              modules=modules, mtimes=[split_info["created"]] * docs.num_rows, cluster_sizes=sizes,
                              created=split_info["created"])
    with atomic_dir(out) as tmp:
        pq.write_table(docs, tmp / "docs.parquet", row_group_size=4096)
        pq.write_table(feats, tmp / "features.parquet")
        records = docs.select(list(FIELDS)).to_pylist()
        for s in SPLITS:
            with open(tmp / f"records-{s}.jsonl", "wb") as f:
                f.writelines((json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8")
                             for r, a in zip(records, split) if a == s)
    counts = {s: split.count(s) for s in SPLITS}
    return ref(out, ["docs.parquet", "features.parquet", *(f"records-{s}.jsonl" for s in SPLITS)], index=index,
               counts=counts, quality_sum=float(np.sum(feats.column("quality_score").to_numpy())))


def encode_shard(finish_dir: str, tok_dir: str, out: Path, *, vocab_size: int) -> dict[str, Any]:
    """Token ids per split, <eos> after each document: tokens-<split>.npy (flat) and lengths-<split>.npy."""
    from lmforge.components.data.shards import dtype_for

    tok = load_tokenizer(Path(tok_dir))
    eos = tok.token_to_id(EOS)
    dtype = dtype_for(vocab_size)
    docs = pq.read_table(Path(finish_dir) / "docs.parquet", columns=["text", "split"])
    texts, split = docs.column("text").to_pylist(), docs.column("split").to_pylist()
    tokens: dict[str, int] = {}
    with atomic_dir(out) as tmp:
        for s in SPLITS:
            batch = [t for t, a in zip(texts, split) if a == s]
            encs = tok.encode_batch_fast(batch, add_special_tokens=False) if batch else []
            lengths = np.fromiter((len(e.ids) + 1 for e in encs), dtype=np.int64, count=len(encs))
            flat = np.empty(int(lengths.sum()), dtype=dtype)
            pos = 0
            for e, n in zip(encs, lengths):
                flat[pos:pos + n - 1] = e.ids
                flat[pos + n - 1] = eos
                pos += n
            np.save(tmp / f"tokens-{s}.npy", flat)
            np.save(tmp / f"lengths-{s}.npy", lengths)
            tokens[s] = int(len(flat))
    return ref(out, [f"{k}-{s}.npy" for s in SPLITS for k in ("tokens", "lengths")], tokens=tokens)
