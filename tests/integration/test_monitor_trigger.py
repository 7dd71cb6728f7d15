"""Drift in the request log starts a real Prefect deployment run, once: the cool-down holds the second.

A loopback Prefect server (the `prefect_server` fixture), a tiny probe flow deployed to a
process work pool, and `monitor_flow` run twice against a request log of shifted
traffic. The assertion is on the server: exactly one flow run of the deployment exists,
the one the trigger recorded. No worker is needed for that.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from lmforge.components.config import load_config
from lmforge.components.serving.requestlog import RequestLog
from lmforge.monitoring.traffic import shifted_prompts
from tests.conftest import TINY_CONFIG
from tests.unit.monitoring.dataset import make_dataset, serve, signatures, write_requests

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROBE = '''
from prefect import flow


@flow(name="train-probe")
def train_probe(cfg: dict | None = None, reason: str = "") -> str:
    return "trained"
'''


def deploy_probe(folder) -> str:
    import asyncio

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    async def pool() -> None:
        async with get_client() as client:
            await client.create_work_pool(WorkPoolCreate(name="monitor-test", type="process"), overwrite=True)

    asyncio.run(pool())
    (folder / "probe.py").write_text(PROBE)
    probe = flow.from_source(source=str(folder), entrypoint="probe.py:train_probe")
    return str(probe.deploy(name="on-demand", work_pool_name="monitor-test", print_next_steps=False))


def deployment_runs(deployment_id: str) -> list:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    async def read() -> list:
        async with get_client() as client:
            return await client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))

    return asyncio.run(read())


def test_drift_triggers_one_deployment_run_and_the_cool_down_holds_the_next(
        prefect_server, workspace, tiny_model_dir, tmp_path):
    from lmforge.flows.monitor import monitor_flow
    from lmforge.monitoring.served import serving_featurizer

    version = make_dataset(workspace, tiny_model_dir)
    assert serve(workspace, tiny_model_dir, version, model_name="lmforge-tiny") == "1"   # the rows' version
    featurize = serving_featurizer(workspace.dataset_dir(version) / "tokenizer", frozenset())
    now = datetime.now(timezone.utc)
    held_out = signatures(workspace, version, "test")
    write_requests(RequestLog(workspace.requests), shifted_prompts(n=120, seed=0, noise=0.3, held_out=held_out),
                   featurize, ts=now - timedelta(seconds=5))
    # Windows are aligned to the clock: two decision windows keep the rows in view when the
    # second pass (now + 5 min) lands in the next hour.
    cfg = load_config(TINY_CONFIG, ["monitoring.training_deployment=train-probe/on-demand",
                                    "monitoring.cooldown_minutes=60", "monitoring.decision_windows=2"])

    with prefect_server.settings():
        deployment_id = deploy_probe(tmp_path)
        first = monitor_flow(cfg, now=now)
        assert first["decision"] == "drift: retrain", first
        assert first["trigger"]["via"] == "deployment" and first["trigger"]["started"] is True
        runs = deployment_runs(deployment_id)
        assert [str(r.id) for r in runs] == [first["trigger"]["flow_run_id"]]
        assert runs[0].parameters["cfg"]["monitoring"]["training_deployment"] == "train-probe/on-demand"
        assert runs[0].parameters["reason"].startswith("drift: retrain")

        second = monitor_flow(cfg, now=now + timedelta(minutes=5))
        assert second["decision"] == "drift: retrain" and second["trigger"]["action"] == "cool-down", second
        assert len(deployment_runs(deployment_id)) == 1

    triggers = [json.loads(line) for line in (workspace.monitoring / "triggers.jsonl").read_text().splitlines()]
    assert [(t["action"], t["started"]) for t in triggers] == [("retrain", True), ("cool-down", False)]
    report = workspace.monitoring / "reports" / (workspace.monitoring / "reports" / "LATEST").read_text().strip()
    assert second["report"] == str(report / "report.html") and (report / "drift_over_time.png").is_file()

    from typer.testing import CliRunner

    from lmforge.cli.commands.monitor import app

    out = CliRunner().invoke(app, ["report"])
    assert out.exit_code == 0, out.output
    assert "drift: retrain" in out.output and "report.html" in out.output
