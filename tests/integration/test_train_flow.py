"""`train_flow` on the tiny config: real ranks, an MLflow run with metrics and artifacts, an export;
resume on 1 rank continues the 2-rank run (through the CLI, universal checkpoint); resume refuses another global
batch and a truncated checkpoint shard (through the CLI, exit 2) and a missing checkpoint.
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

    # Resume on another number of ranks through the CLI (components/training/universal.py): another global batch
    # is refused before any rank starts, with its arithmetic; the same one (1 rank x 2 micro-batches) continues
    # step 6 on 1 rank for one step and says so.
    def resume_cli(*sets: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lmforge.cli", "run", "train", "-c", str(REPO / "configs" / "tiny.toml"),
                               "--resume", *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True,
                              timeout=600, cwd=REPO, env={**os.environ, "COLUMNS": "400"})
    refused = resume_cli("training.num_ranks=1", "training.max_steps=7")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "4 x 1 x 1 = 4, but step-0000006 was trained at 4 x 1 x 2 = 8" in refused.stdout + refused.stderr
    assert "Set training.grad_accum_steps=2" in refused.stdout + refused.stderr
    elastic = resume_cli("training.num_ranks=1", "training.grad_accum_steps=2", "training.max_steps=7")
    assert elastic.returncode == 0, elastic.stdout + elastic.stderr
    assert "resumed step 6 from 2 ranks on 1 (universal checkpoint, converted step-0000006_universal" in elastic.stderr
    assert "7 steps, resumed from step 6" in elastic.stdout

    # A truncated checkpoint shard: the CLI stops with one line and exit code 2 (a UserError, wherever it
    # is raised: cli/cli.py's convention), and trains nothing.
    latest = workspace.run_dir(out["run"]) / "checkpoints" / "step-0000007"  # saved by the 1-rank resume above
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
    assert len(list((workspace.run_dir(out["run"]) / "logs").iterdir())) == 2  # the first launch and the 1-rank resume
