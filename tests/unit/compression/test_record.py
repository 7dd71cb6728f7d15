"""What a compression run records (components/compression/record.py): its MLflow run, the lines it prints, each
variant's tags and the versions in the trade-off table."""

from __future__ import annotations

import math

from lmforge.components.compression import record
from lmforge.components.sections.compression import CompressionConfig

PARENT = {"params": 1000, "disk_bytes": 4e6, "weight_bytes": 4e6, "tokens_per_s": 100.0, "ttft_ms": 10.0,
          "bpc": 2.0, "rougeL": 0.30, "bleu": 10.0, "device": "cpu", "device_reason": "no GPU", "device_fallback": False}


def test_finite_keeps_the_numbers_mlflow_can_log():
    assert record.finite({"bpc": 2, "ttft_ms": math.nan, "device": "cpu", "device_fallback": True}) == {"bpc": 2.0}


def test_variant_tags_carry_the_technique_and_the_parents_base_lineage():
    c = CompressionConfig()
    tags = record.variant_tags("int8", c, parent_version="3", dataset_version="v1",
                               parent_tags={"base_sha256": "abc", "decision": "promoted"})
    assert tags["variant"] == "int8" and tags["technique"] == record.TECHNIQUES["int8"]
    assert tags["run_name"] == "compress-v3-int8" and tags["dataset_version"] == "v1"
    assert tags["base_sha256"] == "abc" and "decision" not in tags


def test_the_tradeoff_rows_name_their_versions():
    rows = record.versioned_rows(PARENT, {"int8": {**PARENT, "weight_bytes": 1e6}}, {"int8": "4"}, CompressionConfig(),
                                 parent_version="3")
    assert [(r["variant"], r["version"]) for r in rows] == [("parent", "3"), ("int8", "4")]


def test_the_run_logs_the_parent_each_variant_and_the_tradeoff(workspace):
    from mlflow import MlflowClient

    from lmforge.components.tracking import start_run
    from lmforge.components.workspace import Workspace

    ws, c = Workspace.from_env().ensure(), CompressionConfig()
    variant = {**PARENT, "weight_bytes": 1e6, "bpc": 2.01}
    rows = record.versioned_rows(PARENT, {"int8": variant}, {"int8": "4"}, c, parent_version="3")
    with start_run(ws, "compression", run_name="compress-v3") as run:
        lines = record.log_start(c, parent_version="3", dataset_version="v1", names=["int8"], parent_metrics=PARENT,
                                 skipped={"lowrank": "no projections"})
        registered = record.log_registered("int8", variant, model="demo", version="4", parent_version="3")
        refused = record.log_refused("prune", "the pyfunc's text differs")
        table = record.log_tradeoff(rows, {"prune": "the pyfunc's text differs"}, chosen="4", why="smallest",
                                    model="demo", parent_version="3")
    assert lines == ["lowrank: not registered: no projections"]
    assert registered == "int8: registered demo v4 (parent v3), BPC 2.0100 on cpu (no GPU), 100.0 tokens/s"
    assert refused == "prune: not registered: the pyfunc's text differs" and table.endswith(refused)
    got = MlflowClient().get_run(run.info.run_id).data
    assert got.tags["parent_version"] == "3" and got.tags["lowrank.not_registered"] == "no projections"
    assert got.tags["prune.not_registered"] == "the pyfunc's text differs" and got.tags["compressed_version"] == "4"
    assert got.metrics["parent.bpc"] == 2.0 and got.metrics["int8.bpc"] == 2.01 and got.params["variants"] == "int8"
    assert {a.path for a in MlflowClient().list_artifacts(run.info.run_id, "tradeoff")} == {
        "tradeoff/tradeoff.md", "tradeoff/tradeoff.json", "tradeoff/tradeoff.png"}
    assert record.result_lines(table, model="demo", parent_version="3", dataset_version="v1", chosen=None, pick=None,
                               why="none within tolerance")[1] == "compressed: none: none within tolerance"
