"""What a data stage run records: its counts (reconciled), the dataset's source, the report and the summary.

    counts = reconciled_counts(sel, near, spl, recs, fins)     # AssertionError when a document went missing
    source = dataset_source(cfg.data, specs, replay, pin=base["pin"])
    report = stage_report(cfg.data, specs=specs, counts=counts, refs=..., tokenizer_from=...)
    summary = stage_summary(report, manifest, dataset_dir)

flows/data.py calls these between its steps; the manifest (components/data/manifest.py) holds the source
and the counts, report.json the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmforge.components.data.stepref import FinishRef, NearRef, RecordsRef, SelectRef, SplitRef, StepRef, TokenizerRef
from lmforge.components.sections.data import DataConfig

SPLITS = ("train", "validation", "test")


def reconciled_counts(sel: SelectRef, near: NearRef, spl: SplitRef, recs: Sequence[RecordsRef],
                      fins: Sequence[FinishRef]) -> dict[str, Any]:
    """Every step's document counts, checked to add up: read = clean + quarantined, clean = kept + duplicates, and
    kept = each split's, each shard's records and tokens."""
    counts = {"records_read": sel.records_read, "sampled_out": sel.sampled_out, "docs_in": sel.docs_in,
              "clean": sel.clean, "quarantined": sel.quarantined,
              "quarantined_by_reason": sel.quarantined_by_reason, "exact_duplicates": sel.exact_duplicates,
              "near_duplicates": near.near_duplicates, "kept": near.kept, **spl.counts}
    assert counts["docs_in"] == counts["clean"] + counts["quarantined"]
    assert counts["clean"] == counts["kept"] + counts["exact_duplicates"] + counts["near_duplicates"]
    assert counts["kept"] == sum(spl.counts.values()) == sum(sum(f.counts.values()) for f in fins) \
        == sum(sum(r.counts.values()) for r in recs)
    return counts


def dataset_source(data: DataConfig, specs: Sequence[dict[str, Any]], replay: Sequence[str] | None,
                   pin: str | None = None) -> dict[str, Any]:
    """What the dataset was made from (part of its version): the input shards' fingerprints, the replayed quarantine
    files, and a registry base's pinned version. Training reads the pin back (components/training/run.py
    pinned_base), so datasets made while an alias held different versions never share a manifest."""
    source = {"kind": "builtin" if data.source is None else "file", "shards": [s["fingerprint"] for s in specs],
              "replay": [str(Path(p).resolve()) for p in replay or []]}
    return {**source, "base": pin} if pin is not None else source


def stage_report(data: DataConfig, *, specs: Sequence[dict[str, Any]], counts: dict[str, Any], near: NearRef,
                 spl: SplitRef, tok: TokenizerRef, fins: Sequence[FinishRef], recs: Sequence[RecordsRef],
                 steps: Sequence[StepRef], tokenizer_from: str | None = None) -> dict[str, Any]:
    """The dataset's report.json: source, counts, dedup, split groups, tokens per split, the tokenizer, the step
    folders it was built from and the features' mean quality."""
    return {"source": data.source or "builtin", "shards": len(specs), "counts": counts,
            "dedup": {"lsh": near.lsh, "examples": near.examples}, "split_groups": spl.groups,
            "tokens": {s: sum(f.tokens[s] for f in fins) for s in SPLITS},
            "tokenizer_trained_on": tok.trained_on, **({"tokenizer_from": tokenizer_from} if tokenizer_from else {}),
            "build_dirs": sorted(Path(r.dir).name for r in steps),
            "features": {"rows": counts["kept"],
                         "quality_mean": round(sum(r.quality_sum for r in recs) / max(counts["kept"], 1), 4)}}


def stage_summary(report: dict[str, Any], manifest: dict[str, Any], dataset_dir: Path) -> dict[str, Any]:
    """The stage's summary: the version, the source, every count, the vocabulary, the tokens and where it is."""
    return {"dataset_version": manifest["version"], "source": report["source"], **report["counts"],
            "vocab_size": manifest["vocab_size"], "tokens": report["tokens"], "dataset_dir": str(dataset_dir),
            "shards": report["shards"]}
