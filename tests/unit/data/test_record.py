"""What a data stage run records (components/data/record.py): counts that reconcile, the dataset's source with a
pinned base, the report and the summary."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from lmforge.components.data import record
from lmforge.components.sections.data import DataConfig

SEL = NS(records_read=12, sampled_out=0, docs_in=12, clean=10, quarantined=2, quarantined_by_reason={"empty": 2},
         exact_duplicates=1, dir="/b/select-1")
NEAR = NS(near_duplicates=1, kept=8, lsh={"bands": 16}, examples=[], dir="/b/near-1")
SPL = NS(counts={"train": 6, "validation": 1, "test": 1}, groups={"train": 3}, dir="/b/split-1")
RECS = [NS(counts={"train": 6, "validation": 1, "test": 1}, quality_sum=4.0, dir="/b/records-1")]
FINS = [NS(counts={"train": 6, "validation": 1, "test": 1}, tokens={"train": 60, "validation": 10, "test": 9},
           dir="/b/finish-1")]
TOK = NS(trained_on=6, dir="/b/tok-1")
SPECS = [{"fingerprint": "f1"}]


def test_the_counts_reconcile_or_the_stage_stops():
    counts = record.reconciled_counts(SEL, NEAR, SPL, RECS, FINS)
    assert counts["kept"] == 8 and counts["train"] == 6 and counts["quarantined_by_reason"] == {"empty": 2}
    with pytest.raises(AssertionError):
        record.reconciled_counts(SEL, NS(**{**vars(NEAR), "kept": 7}), SPL, RECS, FINS)


def test_the_source_pins_a_registry_base_into_the_dataset_version(tmp_path):
    data = DataConfig(source=str(tmp_path))
    plain = record.dataset_source(data, SPECS, [str(tmp_path / "q.jsonl")])
    assert plain == {"kind": "file", "shards": ["f1"], "replay": [str((tmp_path / "q.jsonl").resolve())]}
    assert record.dataset_source(data, SPECS, None, pin="models:/m/3")["base"] == "models:/m/3"
    assert record.dataset_source(DataConfig(), SPECS, None)["kind"] == "builtin"


def test_the_report_and_the_summary():
    counts = record.reconciled_counts(SEL, NEAR, SPL, RECS, FINS)
    report = record.stage_report(DataConfig(), specs=SPECS, counts=counts, near=NEAR, spl=SPL, tok=TOK, fins=FINS,
                                 recs=RECS, steps=[SEL, NEAR, TOK], tokenizer_from="models:/m@champion")
    assert report["tokens"] == {"train": 60, "validation": 10, "test": 9} and report["source"] == "builtin"
    assert report["build_dirs"] == ["near-1", "select-1", "tok-1"] and report["tokenizer_from"] == "models:/m@champion"
    assert report["features"] == {"rows": 8, "quality_mean": 0.5}
    assert "tokenizer_from" not in record.stage_report(DataConfig(), specs=SPECS, counts=counts, near=NEAR, spl=SPL,
                                                       tok=TOK, fins=FINS, recs=RECS, steps=[])
    summary = record.stage_summary(report, {"version": "v1", "vocab_size": 512}, "/ws/datasets/v1")
    assert summary["dataset_version"] == "v1" and summary["kept"] == 8 and summary["tokens"]["test"] == 9
    assert (summary["vocab_size"], summary["shards"], summary["dataset_dir"]) == (512, 1, "/ws/datasets/v1")
