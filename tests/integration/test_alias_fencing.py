"""A claim holder paused past the ttl loses the round: its claim is broken, the breaker moves `champion`, and the
resumed holder's move is refused (ClaimLost) before it writes anything more.

A child process (its own workspace, MLFLOW_TRACKING_URI at one real `mlflow server`) starts to move `champion`
v1 -> v2 and stops itself with SIGSTOP, every thread of it, the claim's heartbeat included, while it holds the
claim: right after it read the holder ("decided"), or right after it wrote its pending audit record ("pending").
This process then moves `champion` v1 -> v3: it waits out the ttl (lowered to TTL_S here and in the child) without
a beat, breaks the claim and moves. Resumed, the child must exit with ClaimLost; the alias is v3, the round has one
move (the breaker's) in the history and the audit trail, and no claim is left; the child adds a record that it
lost. Without fencing the resumed child moves the alias to v2.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.integration.servers import mlflow_server

pytestmark = [pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]
MODEL = "race-fenced"
TTL_S = 3.0
LOST = 4   # the child's exit status on ClaimLost

HOLDER = textwrap.dedent("""
    import os, signal, sys
    from mlflow import MlflowClient
    from lmforge.components.registry import claim as claims, set_alias
    from lmforge.components.registry.audit import AuditLog
    from lmforge.components.workspace import Workspace
    model, holder, target, where, ttl = sys.argv[1:]
    claims.CLAIM_TTL_S = float(ttl)
    cls, name = {"decided": (MlflowClient, "get_model_version_by_alias"), "pending": (AuditLog, "append")}[where]
    real = getattr(cls, name)

    def then_stop(*a, **k):            # the real call, then the whole process stops, as a stopped container would
        out = real(*a, **k)
        setattr(cls, name, real)
        print("stopped", where, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        return out

    setattr(cls, name, then_stop)
    try:
        set_alias(Workspace.from_env(), model, "champion", target, reason="paused mover", expect=holder)
    except claims.ClaimLost as e:
        print(e, flush=True)
        sys.exit(%d)
    print("moved", flush=True)
""" % LOST)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("fencing")) as url:
        yield url


def _stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("where", ["decided", "pending"])
def test_a_holder_paused_past_the_ttl_is_refused_and_the_breaker_moves_once(server, tmp_path, monkeypatch, where):
    from mlflow import MlflowClient

    from lmforge.components.registry import claim as claims
    from lmforge.components.registry import current, history, set_alias
    from lmforge.components.registry.audit import AuditLog
    from lmforge.components.tracking import use_workspace
    from lmforge.components.workspace import Workspace

    model = f"{MODEL}-{where}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "ws-B"))
    monkeypatch.setenv("LMFORGE_ACTOR", "B")
    monkeypatch.setattr(claims, "CLAIM_TTL_S", TTL_S)
    ws = Workspace(tmp_path / "ws-B").ensure()
    use_workspace(ws)
    client = MlflowClient()
    client.create_registered_model(model)
    run = client.create_run(client.create_experiment(f"fencing-{where}"))
    v1, v2, v3 = (str(client.create_model_version(model, f"runs:/{run.info.run_id}/model",
                                                  run_id=run.info.run_id).version) for _ in range(3))
    set_alias(ws, model, "champion", v1, reason="start", expect=None)

    env = {**os.environ, "PYTHONPATH": str(REPO), "LMFORGE_HOME": str(tmp_path / "ws-A"), "LMFORGE_ACTOR": "A"}
    child = subprocess.Popen([sys.executable, "-c", HOLDER, model, v1, v2, where, str(TTL_S)], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not _stopped(child.pid):
            assert child.poll() is None, repr(child.communicate())
            assert time.monotonic() < deadline, "the holder never stopped"
            time.sleep(0.05)
        held = client.get_registered_model(claims.claim_name(model)).tags
        assert (held[claims.PID], held[claims.WHO]) == (str(child.pid), "A")   # it stopped holding the claim

        start = time.monotonic()
        moved = set_alias(ws, model, "champion", v3, reason="breaker", expect=v1)
        assert time.monotonic() - start >= TTL_S     # broken after a ttl without a beat: the holder's pid lives
        assert current(ws, model, "champion") == v3
        os.kill(child.pid, signal.SIGCONT)
        out, err = child.communicate(timeout=240)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait()
    assert child.returncode == LOST, (out, err[-3000:])
    assert out.startswith(f"stopped {where}\n"), out
    assert f"alias claim: {claims.claim_name(model)} was lost before this mover could" in out
    assert "moved" not in out.splitlines()

    assert current(ws, model, "champion") == v3
    champ = history(ws, model, alias="champion")
    assert [(m.from_version, m.to_version, m.who, m.why) for m in champ] == [
        (None, v1, "B", "start"), (v1, v3, "B", "breaker")]
    assert champ[-1] == moved
    lines = AuditLog(client, ws, model).lines()
    done = [line for line in lines if line["state"] == "done"]
    assert [(d["to_version"], d["why"]) for d in done] == [(v1, "start"), (v3, "breaker")]
    paused = [(line["to_version"], line["state"]) for line in lines if line["who"] == "A"]
    # stopped before its pending record: only its own record that it lost; after it: the breaker found it pending
    # and settled it aborted, and the resumed mover added that it lost
    assert paused == ([(v2, "lost")] if where == "decided" else [(v2, "pending"), (v2, "aborted"), (v2, "lost")])
    assert claims.leftover_claims(client) == []
