"""`train_flow` on the tiny config: real ranks, an MLflow run with metrics and artifacts, an export;
resume refuses a truncated checkpoint shard (through the CLI, exit 1) and a missing checkpoint.
The logged MFU is tokens/s x FLOPs/token / the logged peak, and at most 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.components.errors import UserError
from tests.integration.train_support import make_dataset

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]


def test_train_flow_tracks_exports_and_refuses_bad_resumes(workspace, tiny_config):
    from mlflow import MlflowClient
    from transformers import AutoModelForCausalLM

    from lmforge.components.tracking import use_workspace
    from lmforge.flows.train import train_flow

    version = make_dataset(workspace)
    out = train_flow(tiny_config)
    s = out["summary"]
    assert s["steps"] == 6 and s["final_loss"] < s["first_loss"] and s["backend"] == "gloo"
    assert workspace.latest_run() == out["run"]
    export = Path(out["export"])
    meta = json.loads((export / "lmforge.json").read_text())
    assert {"dataset_version", "config_hash", "strategy", "steps", "final_loss", "mlflow_run_id", "git_commit",
            "run_name"} <= set(meta)
    assert (meta["dataset_version"], meta["strategy"], meta["steps"], meta["run_name"]) == (version, "zero2", 6, out["run"])
    assert AutoModelForCausalLM.from_pretrained(export).config.num_hidden_layers == 2

    use_workspace(workspace)
    client = MlflowClient()
    run = client.get_run(meta["mlflow_run_id"])
    assert run.data.tags["dataset_manifest_sha256"] and run.data.tags["strategy"] == "zero2"
    assert run.data.params["parallel.strategy"] == "zero2"
    for key in ("loss", "lr", "tokens_per_s", "mfu", "model_state_mb_rank0", "model_state_mb_rank1"):
        assert len(client.get_metric_history(run.info.run_id, key)) == 6, key
    assert 0 < run.data.metrics["mfu"] < 1
    # The peak says where it came from. (FLOPs/token is checked against torch's FlopCounterMode in
    # tests/unit/training/test_mfu_honesty.py, and MFU against it on a GPU in tests/gpu/test_on_cuda.py.)
    tags = run.data.tags
    assert tags["hardware.precision"] in ("bf16", "fp32") and tags["hardware.precision_reason"]
    assert tags["hardware.peak_source"].startswith(("measured:", "datasheet:"))
    events = [json.loads(line) for line in (workspace.run_dir(out["run"]) / "metrics.jsonl").read_text().splitlines()]
    for ev in events:
        assert ev["peak_flops"] == pytest.approx(float(tags["hardware.peak_flops_per_device"]))  # 2 CPU ranks, one machine
        assert 0 < ev["mfu"] <= 1
    assert s["precision"] == tags["hardware.precision"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)} | \
        {a.path for a in client.list_artifacts(run.info.run_id, "config")} | \
        {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert {"loss_curve.png", "config/deepspeed_config-0.json", "model/model.safetensors", "model/tokenizer.json"} <= artifacts

    # A truncated checkpoint shard: the CLI stops with one line and exit code 2 (a UserError, wherever it
    # is raised: cli/cli.py's convention), and trains nothing.
    latest = workspace.run_dir(out["run"]) / "checkpoints" / "step-0000006"
    shard = next(p for p in sorted(latest.iterdir()) if p.name.endswith("optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cli = subprocess.run([sys.executable, "-m", "lmforge.cli", "run", "train", "-c", str(REPO / "configs" / "tiny.toml"),
                          "--resume", "--set", "training.max_steps=9"], capture_output=True, text=True, timeout=600,
                         cwd=REPO, env={**os.environ, "COLUMNS": "400"})
    assert cli.returncode == 2, cli.stdout + cli.stderr
    assert f"{shard.name} is truncated" in cli.stdout + cli.stderr and "Traceback" not in cli.stdout + cli.stderr

    # No complete checkpoint at all: refused before any rank starts, never a silent fresh start.
    for folder in latest.parent.glob("step-*"):
        (folder / "COMPLETE.json").unlink()
    with pytest.raises(UserError, match="has no complete checkpoint .*Train without --resume"):
        train_flow(tiny_config, resume=True)
    assert len(list((workspace.run_dir(out["run"]) / "logs").iterdir())) == 1  # only the first launch ever ran
