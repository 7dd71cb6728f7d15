"""The evaluate stage as a real Prefect flow: evaluate, log to MLflow, register, gate; then the CLI reads it back."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.integration.evalreg_support import make_eval_dataset, make_run

pytestmark = [pytest.mark.integration]


def test_evaluate_flow_registers_gates_and_reports(workspace, tiny_model_dir, tiny_config):
    from mlflow import MlflowClient

    from lmforge.cli.commands.registry import app
    from lmforge.components.registry import current
    from lmforge.flows.evaluate import evaluate_flow

    version = make_eval_dataset(workspace, per_module=8)
    make_run(workspace, tiny_model_dir, version)
    out = evaluate_flow(tiny_config)

    name = tiny_config.registry.model_name
    d = out["decision"]
    assert out["version"] == "1" and d["candidate_version"] == "1" and d["champion_version"] is None
    assert d["outcome"] in ("promoted", "declined") and "unigram baseline" in d["reason"]
    # a random model either beats token frequencies or not; the alias must follow the decision
    assert current(workspace, name, "champion") == ("1" if d["promote"] else None)
    assert current(workspace, name, "challenger") == "1"
    assert out["rag"]["status"] == "skipped" and out["rag"]["reason"]  # no vector store in this workspace
    assert out["summary"]["decision"] == d["outcome"]

    client = MlflowClient()
    run = client.get_run(out["eval_run_id"])
    assert {"bpc", "unigram_bpc", "rougeL", "bleu", "tokens_per_s"} <= set(run.data.metrics)
    assert run.data.tags["decision"] == d["outcome"]
    files = {f.path for f in client.list_artifacts(run.info.run_id, "report")}
    assert {"report/report.md", "report/report.json", "report/rougeL_hist.png", "report/decision.json"} <= files
    mv = client.get_model_version(name, "1")
    assert mv.tags["dataset_version"] == version and mv.tags["training_run_id"] == "train-run-0"
    assert mv.tags["git_commit"] == "abc123" and len(mv.tags["dataset_manifest_hash"]) == 64

    runner = CliRunner()
    listed = runner.invoke(app, ["list", "--model", name, "--json"])
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.output)[0]["version"] == "1"
    hist = runner.invoke(app, ["history", "--model", name, "--json"])
    assert [m["alias"] for m in json.loads(hist.output)] == ["challenger"] + (["champion"] if d["promote"] else [])
    promoted = runner.invoke(app, ["promote", "1", "--alias", "production", "--reason", "manual", "--model", name])
    assert promoted.exit_code == 0 and current(workspace, name, "production") == "1"


def test_scored_within_the_trained_context_and_champion_rescored_when_the_eval_config_differs(
        workspace, tiny_model_dir, tiny_config):
    from lmforge.components.config import load_config
    from lmforge.components.registry import set_alias, version_tags
    from lmforge.flows.evaluate import evaluate_flow
    from tests.conftest import TINY_CONFIG

    version = make_eval_dataset(workspace, per_module=8)
    run = make_run(workspace, tiny_model_dir, version)
    meta_path = workspace.run_dir(run) / "export" / "lmforge.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "seq_len": 32}))   # trained at 32
    name = tiny_config.registry.model_name

    first = evaluate_flow(tiny_config)                     # the model's max_position_embeddings is 256
    tags = version_tags(workspace, name, first["version"])
    assert tags["evaluation_context"] == "32", tags
    set_alias(workspace, name, "champion", first["version"], reason="test setup")

    same = evaluate_flow(tiny_config)                      # same dataset, config and context: registered metrics
    assert same["decision"]["champion_metrics_source"] == f"champion v{first['version']}: registered metrics"

    other = load_config(TINY_CONFIG, ["evaluation.max_examples=4"])
    changed = evaluate_flow(other)                         # same dataset, another evaluation config: re-scored
    source = changed["decision"]["champion_metrics_source"]
    assert "re-scored (its evaluation config differed)" in source and "at context 32" in source, source
    assert changed["decision"]["champion"]["bpc"] == pytest.approx(changed["metrics"]["bpc"])  # same model, same terms
