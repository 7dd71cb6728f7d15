"""The data stage as steps from files to files; each returns a small reference (paths, hashes, counts).

    ing = run_ingest(cfg, out / "ingest")                      # cfg: DataConfig
    cln = run_clean(ing["kept"], out / "clean")
    ded = run_dedup(cln["kept"], cfg.dedup, out / "dedup")
    spl = run_split(ded["kept"], cfg.split, out / "split", seed=cfg.seed)
    fea = run_features(spl["dir"], out / "features")
    tok = run_tokenizer(spl["dir"], cfg.tokenizer, out / "tokenizer")
    sha = run_shards(spl["dir"], tok["dir"], out / "shards")
    manifest = assemble(ws.datasets, split=spl, features=fea, tokenizer=tok, shards=sha,
                        quarantine=[ing["quarantine"], cln["quarantine"]], counts=..., config_hash=...,
                        source=..., report=..., scratch=out)

flows/data.py wraps each step in a cached Prefect task; benchmarks/bench_data.py runs
them directly. A step writes only under its own output folder, atomically, so a step that
fails leaves nothing that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from lmforge.components.data.clean import clean_all
from lmforge.components.data.dedup import deduplicate
from lmforge.components.data.featurize import document_features
from lmforge.components.data.ingest import ingest
from lmforge.components.data.manifest import build_manifest
from lmforge.components.data.shards import write_shards
from lmforge.components.data.split import SPLITS, split_groups
from lmforge.components.data.store import (iter_jsonl, read_kept, read_quarantine, read_records, write_jsonl, write_kept,
                                   write_quarantine, write_records)
from lmforge.components.data.tokenizer import iter_encoded, load_tokenizer, save_tokenizer, train_tokenizer
from lmforge.components.data.validate import validate_items
from lmforge.components.errors import UserError
from lmforge.components.sections.data import DataConfig, DedupConfig, SplitConfig, TokenizerConfig
from lmforge.components.workspace import atomic_dir, atomic_write_json, sha256_tree

Progress = Callable[[int], None] | None
DATASET_PARTS = ["records/train.jsonl", "records/validation.jsonl", "records/test.jsonl", "quarantine.jsonl",
                 "features.parquet", "tokenizer", "shards"]


def run_ingest(cfg: DataConfig, out: Path, *, progress: Progress = None) -> dict[str, Any]:
    """Read the source and validate it: kept.jsonl (records + provenance) and quarantine.jsonl."""
    ingested = ingest(cfg, progress=progress)
    result = validate_items(ingested.items, cfg.validation)
    with atomic_dir(out) as tmp:
        kept_sha = write_kept(tmp / "kept.jsonl", result.clean)
        q_sha = write_quarantine(tmp / "quarantine.jsonl", result.quarantined)
    return {"kept": str(out / "kept.jsonl"), "kept_sha256": kept_sha, "quarantine": str(out / "quarantine.jsonl"),
            "quarantine_sha256": q_sha, "counts": result.counts(), "ingest": ingested.report}


def run_clean(kept_path: str, out: Path) -> dict[str, Any]:
    kept, _ = read_kept(Path(kept_path))
    cleaned, emptied = clean_all(kept)
    with atomic_dir(out) as tmp:
        kept_sha = write_kept(tmp / "kept.jsonl", cleaned)
        q_sha = write_quarantine(tmp / "quarantine.jsonl", emptied)
    return {"kept": str(out / "kept.jsonl"), "kept_sha256": kept_sha, "quarantine": str(out / "quarantine.jsonl"),
            "quarantine_sha256": q_sha, "emptied": len(emptied)}


def run_dedup(kept_path: str, cfg: DedupConfig, out: Path, *, progress: Progress = None) -> dict[str, Any]:
    kept, _ = read_kept(Path(kept_path))
    res = deduplicate([k.record.text for k in kept], cfg, progress=progress)
    examples = [{"removed": kept[j].origin, "kept": kept[i].origin} for j, i in list(res.duplicate_of.items())[:20]]
    with atomic_dir(out) as tmp:
        sha = write_kept(tmp / "kept.jsonl", [kept[i] for i in res.keep],
                         ({"cluster_size": res.cluster_size[i]} for i in res.keep))
    return {"kept": str(out / "kept.jsonl"), "kept_sha256": sha, "exact_duplicates": res.exact,
            "near_duplicates": res.near, "lsh": {"bands": res.lsh_bands, "rows": res.lsh_rows}, "examples": examples}


def run_split(kept_path: str, cfg: SplitConfig, out: Path, *, seed: int) -> dict[str, Any]:
    """records/{train,validation,test}.jsonl (plain Record dicts) and docs.jsonl (per-document metadata)."""
    kept, extras = read_kept(Path(kept_path))
    if not kept:
        raise UserError("data.source", None, "left no records after validation and deduplication",
                        "Look at quarantine.jsonl in the build folder for the reasons, and fix the input")
    assignment = split_groups([k.record.module for k in kept], cfg, seed=seed)
    with atomic_dir(out) as tmp:
        (tmp / "records").mkdir()
        for s in SPLITS:
            write_records(tmp / "records" / f"{s}.jsonl", (k.record for k, a in zip(kept, assignment) if a == s))
        write_jsonl(tmp / "docs.jsonl", ({"doc_id": k.record.id, "split": a, "module": k.record.module, "origin": k.origin,
                                          "mtime": k.mtime, "cluster_size": e.get("cluster_size", 1)}
                                         for k, e, a in zip(kept, extras, assignment)))
    counts = Counter(assignment)
    return {"dir": str(out), "sha256": sha256_tree(out), "counts": {s: counts.get(s, 0) for s in SPLITS},
            "groups": {s: len({k.record.module for k, a in zip(kept, assignment) if a == s}) for s in SPLITS}}


def _split_texts(split_dir: Path, split: str) -> list[str]:
    return [r.text for r in read_records(split_dir / "records" / f"{split}.jsonl")]


def run_features(split_dir: str, out: Path) -> dict[str, Any]:
    split_dir = Path(split_dir)
    docs = list(iter_jsonl(split_dir / "docs.jsonl"))
    texts_by_id = {r.id: r.text for s in SPLITS for r in read_records(split_dir / "records" / f"{s}.jsonl")}
    table = document_features([d["doc_id"] for d in docs], [texts_by_id[d["doc_id"]] for d in docs],
                              splits=[d["split"] for d in docs], modules=[d["module"] for d in docs],
                              mtimes=[d["mtime"] for d in docs], cluster_sizes=[d["cluster_size"] for d in docs])
    with atomic_dir(out) as tmp:
        pq.write_table(table, tmp / "features.parquet")
    q = table.column("quality_score").to_numpy()
    return {"path": str(out / "features.parquet"), "sha256": sha256_tree(out / "features.parquet"), "rows": table.num_rows,
            "quality_mean": round(float(q.mean()), 4) if len(q) else None}


def run_tokenizer(split_dir: str, cfg: TokenizerConfig, out: Path) -> dict[str, Any]:
    """Trained on the train split only, so held-out text never shapes the vocabulary."""
    texts = _split_texts(Path(split_dir), "train")
    tok = train_tokenizer(texts, cfg)
    with atomic_dir(out) as tmp:
        save_tokenizer(tok, tmp)
    return {"dir": str(out), "sha256": sha256_tree(out / "tokenizer.json"), "vocab_size": tok.get_vocab_size()}


def run_shards(split_dir: str, tok_dir: str, out: Path, *, progress: Progress = None) -> dict[str, Any]:
    tok = load_tokenizer(Path(tok_dir))
    with atomic_dir(out) as tmp:
        index = write_shards(tmp, {s: iter_encoded(tok, _split_texts(Path(split_dir), s), progress=progress) for s in SPLITS},
                             vocab_size=tok.get_vocab_size())
    return {"dir": str(out), "sha256": sha256_tree(out), "tokens": {s: v["tokens"] for s, v in index["splits"].items()}}


def _place(src: Path, dst: Path) -> None:
    """Hard-link a finished build file into the dataset folder (a copy across file systems)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, dst)


def _link_or_copy(src: Any, dst: Any) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def assemble(dataset_root: Path, *, split: dict, features: dict, tokenizer: dict, shards: dict,
             quarantine: list[str], counts: dict[str, Any], config_hash: str, source: dict[str, Any],
             report: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """Hash the finished parts, then build datasets/<version> under a temporary name and rename it into place.

    When a dataset with the same version already exists it is left as it is: same version, same content.
    """
    merged = Path(scratch) / "quarantine.jsonl"
    write_quarantine(merged, [q for path in quarantine for q in read_quarantine(Path(path))])
    sources = {f"records/{s}.jsonl": Path(split["dir"]) / "records" / f"{s}.jsonl" for s in SPLITS}
    sources |= {"quarantine.jsonl": merged, "features.parquet": Path(features["path"]),
                "tokenizer": Path(tokenizer["dir"]), "shards": Path(shards["dir"])}
    assert sorted(sources) == sorted(DATASET_PARTS)
    manifest = build_manifest(counts=counts, hashes={p: sha256_tree(src) for p, src in sources.items()},
                              config_hash=config_hash, tokenizer_hash=tokenizer["sha256"],
                              vocab_size=tokenizer["vocab_size"], source=source)
    final = Path(dataset_root) / manifest["version"]
    if (final / "manifest.json").is_file():
        return json.loads((final / "manifest.json").read_text())
    with atomic_dir(final) as tmp:
        for part, src in sources.items():
            _place(src, tmp / part)
        atomic_write_json(tmp / "report.json", {**report, "version": manifest["version"]})
        atomic_write_json(tmp / "manifest.json", manifest)  # last: a folder with a manifest is complete
    return manifest
