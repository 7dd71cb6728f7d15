"""The whole drift loop, for real: Prefect flows, the MLflow registry, a Triton server, DeepSpeed training.

    v1 serves -> shifted traffic through Triton -> monitor: drift -> retrain (data with the new
    domain, train, evaluate + gate, compress, deploy) -> v2 refused (gate margin) and v1 keeps
    serving, then v3 wins and serves -> a rollout whose final reload fails leaves v3 and the alias.

One workspace and one Triton server for the module; the tests run in order. configs/tiny.toml
with compression off (the compress stage still runs and says it is disabled) keeps it to
minutes. The retrain lock is tested beside it: a held lock makes a retrain return "busy".
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import sysconfig
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from lmforge.components.config import load_config
from lmforge.components.serving.records import Record
from tests.conftest import REPO, TINY_CONFIG

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(2400)]

NEW_DOMAIN = ("click", "rich", "typer", "pydantic", "requests", "jinja2", "httpx", "starlette", "yaml", "urllib3")
# Two day-long decision windows: the traffic stays in view if the monitor runs just after midnight UTC.
BASE = ["compression.enabled=false", "monitoring.window_minutes=1440", "monitoring.decision_windows=2",
        "monitoring.lookback_windows=1",
        "monitoring.cooldown_minutes=0", "registry.rougeL_tolerance=1.0", "deploy.validation_latency_ms=60000"]


def new_domain_corpus(path: Path, limit: int = 240) -> Path:
    """Third-party docstrings (the shifted traffic's domain) as a JSONL corpus: text, prompt, reference, module."""
    root = Path(sysconfig.get_paths()["purelib"])
    rows = []
    for pkg in NEW_DOMAIN:
        for f in sorted((root / pkg).rglob("*.py"))[:20] if (root / pkg).is_dir() else []:
            try:
                tree = ast.parse(f.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and (doc := ast.get_docstring(node)) and len(doc) > 40:
                    r = Record.from_parts(source="site", module=f"{pkg}.{f.stem}", qualname=node.name,
                                          signature=f"def {node.name}({ast.unparse(node.args)})", docstring=doc)
                    rows.append({"id": r.id, "text": r.text, "prompt": r.signature, "reference": r.summary,
                                 "module": r.module})
    assert len(rows) >= limit // 2, f"only {len(rows)} third-party docstrings found"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:limit]))
    return path


class Loop:
    def __init__(self, ws, corpus: Path) -> None:
        self.ws, self.corpus = ws, corpus

    def cfg(self, *extra: str):
        return load_config(TINY_CONFIG, [*BASE, f"monitoring.retrain_source={self.corpus}", *extra])

    def production(self) -> str | None:
        from lmforge.components.registry import current

        return current(self.ws, "lmforge-tiny", "production")

    def triton_serves(self) -> list[int]:
        from lmforge.deploy import client
        from lmforge.deploy.server import running_server

        url = running_server(self.ws).url
        return sorted(v for v, ready in client.ready_versions(url, "lmforge").items() if ready)

    def shifted_traffic(self, n: int = 120) -> int:
        from lmforge.deploy import client
        from lmforge.deploy.server import running_server
        from lmforge.monitoring.traffic import shifted_prompts

        url = running_server(self.ws).url
        prompts = shifted_prompts(n=n, seed=0, noise=0.3, held_out=["def f(x)"])
        answered = 0
        for i in range(0, n, 8):
            try:
                answered += len(client.generate(url, prompts[i:i + 8], model="lmforge", timeout=120))
            except client.RequestFailed:
                pass   # a refused batch is logged as refused; the rest still count
        return answered


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    from lmforge.components.registry import current, set_alias
    from lmforge.components.workspace import Workspace
    from lmforge.deploy import deployment
    from lmforge.flows.data import data_flow
    from lmforge.flows.deploy import deploy_flow
    from lmforge.flows.evaluate import evaluate_flow
    from lmforge.flows.train import train_flow

    root = tmp_path_factory.mktemp("loop")
    ws = Workspace(root / "ws").ensure()
    old = os.environ.get("LMFORGE_HOME")
    os.environ["LMFORGE_HOME"] = str(ws.root)
    lp = Loop(ws, new_domain_corpus(root / "new_domain.jsonl"))
    try:
        v1cfg = lp.cfg("training.max_steps=3")
        data_flow(v1cfg)
        train_flow(v1cfg)
        ev = evaluate_flow(v1cfg)
        if not ev["decision"]["promote"]:   # a 3-step model may not beat the unigram baseline; v1 serves anyway
            set_alias(ws, "lmforge-tiny", "champion", ev["version"], reason="test setup: v1 serves")
        deploy_flow(v1cfg)
        assert lp.production() == "1" and current(ws, "lmforge-tiny", "champion") == "1"
        yield lp
    finally:
        deployment.stop(ws)
        if old is None:
            os.environ.pop("LMFORGE_HOME", None)
        else:
            os.environ["LMFORGE_HOME"] = old


def test_drift_retrains_and_the_gate_refuses_v2_so_v1_keeps_serving(loop):
    from lmforge.flows.monitor import monitor_flow

    assert loop.triton_serves() == [1]
    assert loop.shifted_traffic() >= 100
    out = monitor_flow(loop.cfg("training.max_steps=3", "registry.bpc_margin=10.0"), now=datetime.now(timezone.utc))
    assert out["decision"] == "drift: retrain" and out["served_version"] == "1", out
    r = out["retrain"]
    assert out["trigger"]["started"] is True and r["outcome"] == "refused", r
    assert r["candidate"] == "2" and r["serving"] == "1"
    assert r["reason"].startswith("gate: ") and "below the margin 10.0" in r["reason"], r["reason"]
    assert r["stages"]["corpus"]["new"] > 0 and "deploy" not in r["stages"]
    records = Path(r["stages"]["data"]["dataset_dir"]) / "records"                # the new domain is in the data
    modules = {json.loads(line)["module"].split(".")[0] for split in ("train", "validation", "test")
               for line in (records / f"{split}.jsonl").read_text().splitlines() if line.strip()}
    assert modules & set(NEW_DOMAIN) and modules - set(NEW_DOMAIN), sorted(modules)[:20]
    assert loop.production() == "1" and loop.triton_serves() == [1]


def test_drift_retrains_and_v3_wins_and_serves(loop):
    from lmforge.components.registry import current
    from lmforge.flows.monitor import monitor_flow

    out = monitor_flow(loop.cfg("training.max_steps=12", "registry.bpc_margin=0.0"), now=datetime.now(timezone.utc))
    assert out["decision"] == "drift: retrain" and out["served_version"] == "1", out   # v1's rows, v1's reference
    r = out["retrain"]
    assert r["outcome"] == "serving", r
    assert r["candidate"] == "3" and r["serving"] == "3" and "rollout passed" in r["reason"]
    assert current(loop.ws, "lmforge-tiny", "champion") == "3"
    assert loop.production() == "3" and loop.triton_serves() == [3]
    journal = [json.loads(line) for line in (loop.ws.monitoring / "retrains.jsonl").read_text().splitlines()]
    assert [(j["outcome"], j["serving"]) for j in journal] == [("refused", "1"), ("serving", "3")]


def test_a_failed_final_reload_leaves_the_old_version_serving_and_the_alias(loop, monkeypatch):
    from lmforge.deploy import client, deployment
    from lmforge.deploy.rollout import RolloutRefused
    from lmforge.deploy.server import running_server

    cfg = loop.cfg()
    info = running_server(loop.ws)
    real, calls = client.wait_versions, []

    def wait_versions(url, model, versions, **kw):   # the candidate's load and the switch work; the final reload fails
        calls.append(list(versions))
        if len(calls) == 3:
            raise client.RequestFailed("injected: the final reload failed")
        return real(url, model, versions, **kw)

    monkeypatch.setattr(client, "wait_versions", wait_versions)
    with pytest.raises(RolloutRefused, match="the final reload failed"):
        deployment.deploy_version(loop.ws, cfg.deploy, info, registry_model="lmforge-tiny", version=2, model_dir=None)
    assert len(calls) >= 4, calls   # the restore waited for the old version again
    assert loop.production() == "3" and loop.triton_serves() == [3]


def test_no_result_of_the_loop_was_pickled(loop):
    """Every result Prefect persisted while the loop ran (data, train, evaluate, deploy, monitor, retrain) is
    JSON: a result record whose serializer is JSON, or a flow's JSON value. A pickled result, read back on a
    cache hit, would run code; it would be raw pickle bytes or a record naming the pickle serializer."""
    from prefect.settings import get_current_settings

    storage = Path(get_current_settings().results.local_storage_path)
    files = [p for p in storage.rglob("*") if p.is_file()]
    assert len(files) >= 10, f"only {len(files)} persisted results in {storage}"
    not_json = {}
    for p in files:
        try:
            value = json.loads(p.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            not_json[p.name] = f"not JSON: {e}"
            continue
        serializer = value.get("metadata", {}).get("serializer", {}) if isinstance(value, dict) else {}
        if serializer and serializer.get("type") != "json":
            not_json[p.name] = f"serializer {serializer.get('type')}"
    assert not_json == {}, f"{len(not_json)} of {len(files)} results are not JSON: {not_json}"


HOLD = """
import sys, time
from pathlib import Path
from lmforge.components.workspace import Workspace
from lmforge.flows.retrain import retrain_lock
with retrain_lock(Workspace(Path(sys.argv[1]))) as holder:
    assert holder is None, holder
    Path(sys.argv[2]).touch()
    time.sleep(120)
"""


def test_one_retrain_at_a_time(workspace, tmp_path, tiny_config):
    from lmforge.flows.retrain import retrain_busy, retrain_flow

    ready = tmp_path / "held"
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(workspace.root), str(ready)], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not ready.exists() and time.time() < deadline and child.poll() is None:
            time.sleep(0.1)
        assert ready.exists(), child.stderr.read() if child.poll() is not None else "the child never took the lock"
        assert f"pid {child.pid}" in (retrain_busy(workspace) or "")
        out = retrain_flow(tiny_config, reason="test")
        assert out["outcome"] == "busy" and f"pid {child.pid}" in out["reason"] and out["stages"] == {}
        assert workspace.latest_dataset() is None        # nothing ran
    finally:
        child.kill()
        child.wait(timeout=30)
    assert retrain_busy(workspace) is None                # the kernel dropped the dead holder's lock


def test_a_failed_retrain_is_recorded_with_the_reason_and_releases_the_lock(workspace, tiny_config):
    from lmforge.components.errors import UserError
    from lmforge.flows.retrain import retrain_busy, retrain_flow

    with pytest.raises(UserError, match="served model: lmforge-tiny@production is not set"):
        retrain_flow(tiny_config, reason="test")               # nothing serves: nothing to retrain from
    (record,) = [json.loads(line) for line in (workspace.monitoring / "retrains.jsonl").read_text().splitlines()]
    assert record["outcome"] == "failed" and record["serving"] is None
    assert record["reason"].startswith("corpus failed: UserError: served model: lmforge-tiny@production"), record
    assert retrain_busy(workspace) is None
