"""The train stage's bookkeeping (components/training/run.py): its run folder and record, what it prints, logs to
MLflow and returns as its summary."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from lmforge.components.errors import UserError
from lmforge.components.sections.training import TrainingConfig
from lmforge.components.serving.task import DEMO
from lmforge.components.training import run as runs
from lmforge.components.workspace import RUN_FILE, Workspace

STEPS = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 100.0 * s, "mfu": 0.01 * s} for s in range(1, 8)]


@pytest.fixture
def ws(workspace) -> Workspace:
    return Workspace.from_env().ensure()


def fake_job(tmp_path, *, base=None, notes=("SFT batching: packed (why)",)):
    hardware = SimpleNamespace(summary=lambda: "cpu: fp32 (auto, and the zero-bubble schedule trains in fp32)",
                               to_dict=lambda: {"device": "cpu", "precision": "fp32"},
                               precision=SimpleNamespace(name="fp32"))
    request = SimpleNamespace(attempt=0, meta={"git_commit": "c0ffee", **({"base": {"sha256": "abc"}} if base else {})})
    return SimpleNamespace(hardware=hardware, notes=notes, base=base, start_step=3,
                           ds_config={"zero_optimization": {"stage": 0}}, layout=SimpleNamespace(to_dict=lambda: {"pp": 2}),
                           launch=SimpleNamespace(request=request))


def test_a_fresh_run_starts_from_an_empty_folder_and_a_resume_keeps_its_own_dataset(ws):
    tc = TrainingConfig(run_name="r1")
    stale = ws.run_dir("r1") / "checkpoints" / "step-0000009"
    stale.mkdir(parents=True)
    run = runs.open_run(ws, tc, config_name="tiny", resume=False, dataset_version="v2")
    assert not stale.exists() and run.run_dir.is_dir() and run.note is None   # nothing a --resume could mistake
    assert run.record["dataset_version"] == "v2" and "mlflow_run_id" not in run.record
    assert run.save("mlrun1")["mlflow_run_id"] == "mlrun1"
    assert json.loads((run.run_dir / RUN_FILE).read_text())["mlflow_run_id"] == "mlrun1"
    again = runs.open_run(ws, tc, config_name="tiny", resume=True, dataset_version="v3")
    assert again.dataset_version == "v2" and again.record["mlflow_run_id"] == "mlrun1"
    assert again.note == "note: resuming r1 on its own dataset v2 (latest is v3)"
    with pytest.raises(UserError, match="--resume: .*r2 is not a training run"):
        runs.open_run(ws, TrainingConfig(run_name="r2"), config_name="tiny", resume=True, dataset_version="v3")


def test_the_lines_printed_before_launch_name_the_hardware_and_the_base(tmp_path):
    base = SimpleNamespace(ref="models:/m@champion", version="3", path=tmp_path, architecture="LlamaForCausalLM",
                           sha256="0123456789abcdef")
    lines = runs.job_lines(fake_job(tmp_path, base=base), DEMO)
    assert lines[0].startswith("task: docstring")
    assert lines[1] == "hardware: cpu: fp32 (auto, and the zero-bubble schedule trains in fp32)"
    assert lines[2] == "SFT batching: packed (why)"
    assert lines[3] == f"base: models:/m@champion = version 3 at {tmp_path} (LlamaForCausalLM, sha256 0123456789ab)"


def test_params_tags_and_summary(tmp_path):
    tc = TrainingConfig()
    params = runs.run_params(tc)
    assert params["parallel.strategy"] == tc.parallel.strategy and all(len(v) <= 500 for v in params.values())
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    tags = runs.run_tags(fake_job(tmp_path, base=object()), tc, dataset_version="v1", manifest=manifest)
    assert tags["dataset_version"] == "v1" and len(tags["dataset_manifest_sha256"]) == 64
    assert tags["hardware.precision"] == "fp32" and tags["base.sha256"] == "abc" and tags["git_commit"] == "c0ffee"
    summary = runs.run_summary(fake_job(tmp_path), tc, STEPS, {"seconds": 12.34, "backend": "gloo"}, name="r1",
                               dataset_version="v1", resume=True)
    assert (summary["first_loss"], summary["final_loss"], summary["steps"], summary["resumed_from"]) == (4.9, 4.3, 7, 3)
    assert summary["tokens_per_s"] == 500.0 and summary["mfu"] == 0.05   # the mean of the last five steps
    assert (summary["seconds"], summary["precision"], summary["dataset"]) == (12.3, "fp32", "v1")


def test_log_start_and_end_write_the_run_record_into_mlflow(ws, tmp_path):
    from mlflow import MlflowClient

    from lmforge.components.tracking import start_run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in STEPS))
    tc = TrainingConfig()
    with start_run(ws, "training", run_name="r1") as tracked:
        runs.log_start(fake_job(tmp_path), tc, {"name": "tiny"}, manifest=tmp_path / "none.json", dataset_version="v1")
        steps = runs.log_end(run_dir, title="r1", seconds=3.0, log_model=False)
    assert steps[-1]["loss"] == STEPS[-1]["loss"]
    got = MlflowClient().get_run(tracked.info.run_id)
    assert got.data.params["parallel.strategy"] == tc.parallel.strategy
    assert got.data.tags["dataset_version"] == "v1" and got.data.tags["dataset_manifest_sha256"] == ""
    assert got.data.metrics["final_loss"] == STEPS[-1]["loss"] and got.data.metrics["train_seconds"] == 3.0
    artifacts = {a.path for a in MlflowClient().list_artifacts(tracked.info.run_id)}
    assert {"config", "loss_curve.png"} <= artifacts
