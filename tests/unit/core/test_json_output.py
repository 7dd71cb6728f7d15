"""`--json` on every reporting command prints one JSON document and nothing else on stdout.

`lmforge run <stage> --json` is parsed by tests/integration/test_wheel.py (it runs the data stage
from the installed wheel); the Triton-backed ones (`serve --json`, `generate --json`,
`deploy rollback --json`) need a server and are exercised there in spirit by `deploy stop --json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def lmforge_json(ws, *args: str) -> object:
    env = {**os.environ, "LMFORGE_HOME": str(ws.root), "COLUMNS": "80"}
    r = subprocess.run([sys.executable, "-m", "lmforge.cli", *args, "--json"], cwd=ws.root, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (args, r.stderr[-2000:])
    return json.loads(r.stdout)   # the whole of stdout: one document, nothing before or after it


@pytest.fixture
def reporting_workspace(workspace, tiny_model_dir):
    """A workspace holding one registered model version, an alias move and a drift report."""
    from lmforge.components.registry import register_model, set_alias
    from lmforge.components.sections.registry import RegistryConfig

    cfg = RegistryConfig()
    version = register_model(workspace, cfg, tiny_model_dir, metrics={"bpc": 2.5}, tags={"dataset_manifest_hash": "m0"})
    set_alias(workspace, cfg.model_name, "champion", version, reason="test", action="promote")
    report = workspace.monitoring / "reports" / "r1"
    report.mkdir(parents=True)
    (report / "summary.json").write_text(json.dumps({"decision": "no drift", "drift": {"reason": "few rows"}}))
    (workspace.monitoring / "reports" / "LATEST").write_text("r1\n")
    return workspace


@pytest.mark.slow
def test_every_reporting_command_prints_parseable_json(reporting_workspace):
    ws = reporting_workspace
    status = lmforge_json(ws, "status")
    assert status["workspace"] == str(ws.root)
    assert {k: str(v) for k, v in status["registered_models"][0]["aliases"].items()} == {"champion": "1"}

    versions = lmforge_json(ws, "registry", "list")
    assert [str(v["version"]) for v in versions] == ["1"]
    moves = lmforge_json(ws, "registry", "history")
    assert moves[-1]["alias"] == "champion" and moves[-1]["why"] == "test"

    report = lmforge_json(ws, "monitor", "report")
    assert report["decision"] == "no drift" and report["report_html"].endswith("report.html")

    plan = lmforge_json(ws, "plan", "--model", "1b", "--devices", "4", "--memory-gb", "24")
    assert plan["recommended"]

    prefect = lmforge_json(ws, "prefect", "status")
    assert prefect["server"] == {"up": False} and prefect["runs_report_to"]["kind"]

    stopped = lmforge_json(ws, "deploy", "stop")
    assert stopped["stopped"] is False
