"""The per-shard steps of the data stage: each reads one shard's files and writes its own folder.

    ing = ingest_shard(spec, cfg, out / "ingest-0003")                 # spec: from readers.plan_shards
    rec = finish_records(ing, sel, near, spl, out / "records-0003")    # refs from corpuswork.py
    fin = finish_shard(ing, sel, near, spl, tok, out / "finish-0003")  # token ids: after the tokenizer

Every function returns a small reference (components/data/stepref.py): the folder, the
SHA-256 of each file in it, and the step's counts (IngestRef, RecordsRef, FinishRef). A shard
holds its documents as Parquet (Arrow record batches); memory grows with the shard, not the
corpus. Two passes over the text, one per side of the corpus-wide decisions: ingest (read,
validate, clean, MinHash signatures) and finish (features and records, which need no tokenizer
and run while it trains; then token ids). The global
decisions between them (sampling, duplicate ids, exact and near duplicates, the split, the
tokenizer) are made by components/data/corpuswork.py from small per-shard columns and
handed back as per-shard masks.
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
from lmforge.components.data.minhash import signatures
from lmforge.components.data.quarantine import Quarantined, quarantine_entry, write_quarantine
from lmforge.components.data.readers import read_shard
from lmforge.components.data.shards import dtype_for
from lmforge.components.data.split import SPLITS
from lmforge.components.data.stepref import FinishRef, IngestRef, NearRef, RecordsRef, SelectRef, SplitRef, StepRef, TokenizerRef
from lmforge.components.data.tokenizer import encode_flat, eos_id_of, load_tokenizer
from lmforge.components.data.validate import judge_for_cleaning
from lmforge.components.sections.data import DataConfig
from lmforge.components.serving.records import FIELDS, stored
from lmforge.components.workspace import atomic_dir

ROWS = "rows.parquet"
QUARANTINE = "quarantine.jsonl"
SIG = "sig.npy"  # (rows, num_perm) uint32 MinHash signatures, one per row of ROWS
ROW_SCHEMA = pa.schema([*((f, pa.string()) for f in FIELDS), ("origin", pa.string()), ("mtime", pa.float64()),
                        ("sample_key", pa.uint64()), ("text_hash", pa.binary(16)), ("qsource", pa.string()),
                        ("qline", pa.int64()), ("qformat", pa.string()), ("qmeta", pa.string()), ("raw", pa.large_binary())])


def sample_key(seed: int, origin: str) -> int:
    """Where a record falls in the seeded sample order: the same for a record in any shard or run."""
    return int.from_bytes(hashlib.sha256(f"{seed}\x1f{origin}".encode("utf-8", "surrogatepass")).digest()[:8], "little")


def record_line(r: dict[str, Any]) -> str:
    """A record as one JSONL line. U+2028 and U+2029 are escaped, as json escapes \\r: a consumer that splits the
    file with str.splitlines() still sees one record a line (the JSON text and its value are unchanged)."""
    return json.dumps(stored(r), ensure_ascii=False, sort_keys=True).replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def ingest_shard(spec: dict[str, Any], cfg: DataConfig, out: Path) -> IngestRef:
    """Read, validate and clean one input shard: rows.parquet (clean records + their raw), quarantine.jsonl and
    sig.npy (each row's MinHash signature, with cfg.dedup's num_perm and shingle)."""
    tally: dict[str, Any] = {}
    cols: dict[str, list[Any]] = {name: [] for name in ROW_SCHEMA.names}
    bad: list[Quarantined] = []
    for item in read_shard(spec, cfg, tally):
        judged = judge_for_cleaning(item, cfg.validation)
        if isinstance(judged, Quarantined):
            bad.append(judged)
            continue
        r = clean_record(*judged)
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
    sig = signatures(table.column("text").combine_chunks(), num_perm=cfg.dedup.num_perm, shingle=cfg.dedup.shingle)
    with atomic_dir(out) as tmp:
        pq.write_table(table, tmp / ROWS, row_group_size=4096)
        np.save(tmp / SIG, sig)
        n_bad = write_quarantine(tmp / QUARANTINE, bad)
    reasons: dict[str, int] = {}
    for q in bad:
        reasons[q.reason] = reasons.get(q.reason, 0) + 1
    return IngestRef.of(out, [ROWS, QUARANTINE, SIG], index=spec["index"], records_read=tally["records_read"],
                        rows=table.num_rows, quarantined=n_bad, quarantined_by_reason=dict(sorted(reasons.items())),
                        files_read=tally.get("files", 0))


def quarantined_row(row: dict[str, Any], reason: str, detail: str) -> Quarantined:
    """The quarantine entry of a clean row judged bad later (a duplicate id), from the raw it carries."""
    from lmforge.components.data.quarantine import encode_raw

    return Quarantined(origin=row["origin"], reason=reason, detail=detail, source=row["qsource"], line=row["qline"],
                       format=row["qformat"], meta=json.loads(row["qmeta"]) if row["qmeta"] else {}, **encode_raw(row["raw"]))


def load_mask(step: StepRef, name: str, index: int) -> np.ndarray:
    """A per-shard decision a corpus-wide step wrote: `<name>-<index>.npy` in its folder."""
    return np.load(step.path(f"{name}-{index:05d}.npy"))


def kept_rows(ing: IngestRef, sel: SelectRef, near: NearRef, columns: list[str]) -> pa.Table:
    """The shard's rows that survived select (sampled, unique id and text) and near-dedup, in row order."""
    t = pq.read_table(ing.path(ROWS), columns=columns)
    if not t.num_rows:
        return t
    t = t.filter(pa.array(load_mask(sel, "unique", ing.index)))
    return t.filter(pa.array(load_mask(near, "keep", ing.index)))


def _kept_with_split(ing: IngestRef, sel: SelectRef, near: NearRef, spl: SplitRef,
                     columns: list[str]) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    """The shard's kept rows (those columns), each one's split, and split.json."""
    rows = kept_rows(ing, sel, near, columns).to_pylist()
    split_info = json.loads(spl.path("split.json").read_text())
    places = split_info["places"]  # only the groups that are not in train
    return rows, [places.get(r["module"], "train") for r in rows], split_info


def finish_records(ing: IngestRef, sel: SelectRef, near: NearRef, spl: SplitRef, out: Path) -> RecordsRef:
    """The shard's kept documents with their split: records-<split>.jsonl and features.parquet. It needs no
    tokenizer, so the flow runs it while the tokenizer trains."""
    records, split, split_info = _kept_with_split(ing, sel, near, spl, list(FIELDS))
    keep = load_mask(near, "keep", ing.index)
    sizes = load_mask(near, "cluster", ing.index)
    sizes = sizes[keep] if len(keep) else sizes
    feats = document_features([r["id"] for r in records], [r["text"] for r in records], splits=split,
                              modules=[r["module"] for r in records], mtimes=[split_info["created"]] * len(records),
                              cluster_sizes=sizes, created=split_info["created"])
    with atomic_dir(out) as tmp:
        pq.write_table(feats, tmp / "features.parquet")
        for s in SPLITS:
            with open(tmp / f"records-{s}.jsonl", "wb") as f:
                f.writelines((record_line(r) + "\n").encode("utf-8") for r, a in zip(records, split) if a == s)
    files = ["features.parquet", *(f"records-{s}.jsonl" for s in SPLITS)]
    return RecordsRef.of(out, files, index=ing.index, counts={s: split.count(s) for s in SPLITS},
                         quality_sum=float(np.sum(feats.column("quality_score").to_numpy())))


def finish_shard(ing: IngestRef, sel: SelectRef, near: NearRef, spl: SplitRef, tok: TokenizerRef, out: Path) -> FinishRef:
    """The shard's kept documents' token ids per split, with <eos> after each document: tokens-<split>.npy (flat)
    and lengths-<split>.npy."""
    rows, split, _ = _kept_with_split(ing, sel, near, spl, ["text", "module"])
    tokenizer, dtype = load_tokenizer(Path(tok.dir)), dtype_for(tok.vocab_size)
    eos = eos_id_of(Path(tok.dir), tokenizer)
    tokens: dict[str, int] = {}
    with atomic_dir(out) as tmp:
        for s in SPLITS:
            flat, lengths = encode_flat(tokenizer, [r["text"] for r, a in zip(rows, split) if a == s], dtype, eos_id=eos)
            np.save(tmp / f"tokens-{s}.npy", flat)
            np.save(tmp / f"lengths-{s}.npy", lengths)
            tokens[s] = int(len(flat))
    files = [f"{k}-{s}.npy" for s in SPLITS for k in ("tokens", "lengths")]
    return FinishRef.of(out, files, index=ing.index, counts={s: split.count(s) for s in SPLITS}, tokens=tokens)
