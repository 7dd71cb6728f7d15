"""The alias lease with real processes: a paused holder cannot erase the trail, a guard left by a killed breaker
expires, and on PostgreSQL the database lock refuses a paused holder's write.

Each holder is a child process (its own workspace, the same registry) that stops itself with SIGSTOP, every thread
of it, the claim's heartbeat included, at a chosen point of its move; this process then moves the alias itself.
The ttl is lowered to TTL_S here and in the children.
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
TTL_S = 2.0
LOST = 4   # a child's exit status on ClaimLost

# Moves `champion` holder -> target; stops itself right after the call `cls.name` whose first text argument holds
# `when` (Claim.verify: the check, before the write it guards; AuditLog.append: after a write).
MOVER = textwrap.dedent("""
    import os, signal, sys
    from lmforge.components.registry import claim as claims, set_alias
    from lmforge.components.registry.audit import AuditLog
    from lmforge.components.workspace import Workspace
    model, holder, target, where, when, ttl = sys.argv[1:]
    claims.CLAIM_TTL_S = float(ttl)
    cls, name = {"verify": (claims.Claim, "verify"), "append": (AuditLog, "append")}[where]
    real = getattr(cls, name)

    def then_stop(self, first, *a, **k):
        out = real(self, first, *a, **k)
        if when in str(first):
            setattr(cls, name, real)
            print("stopped", flush=True)
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

# Breaks the claim of `model` as stale, from another host (so its pid cannot be checked here: only the ttl tells
# it is gone), and stops once it holds the break guard, to be killed there.
BREAKER = textwrap.dedent("""
    import os, signal, socket, sys
    from mlflow import MlflowClient
    from lmforge.components.registry import claim as claims
    model, ttl = sys.argv[1:]
    socket.gethostname = lambda: "breaker-host"
    real = claims._create

    def then_stop(client, name, tags):
        made = real(client, name, tags)
        if made and claims.BREAK_INFIX in name:
            print("guard", name, flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return made

    claims._create = then_stop
    claims.Claim(MlflowClient(), model, ttl_s=float(ttl)).acquire(wait_s=60)
    print("acquired", flush=True)
""")


def _stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def _start(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO), **env})
    deadline = time.monotonic() + 240
    while not _stopped(child.pid):
        assert child.poll() is None, repr(child.communicate())
        assert time.monotonic() < deadline, "the child never stopped"
        time.sleep(0.05)
    return child


def _finish(child: subprocess.Popen) -> tuple[str, str]:
    """Resume the child and collect its output (killing it if it hangs)."""
    try:
        os.kill(child.pid, signal.SIGCONT)
        return child.communicate(timeout=240)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def _versions(client, model: str, n: int) -> list[str]:
    client.create_registered_model(model)
    exp = client.get_experiment_by_name("lease") or client.get_experiment(client.create_experiment("lease"))
    run = client.create_run(exp.experiment_id)
    return [str(client.create_model_version(model, f"runs:/{run.info.run_id}/model", run_id=run.info.run_id).version)
            for _ in range(n)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("lease")) as url:
        yield url


@pytest.fixture
def ws_b(server, tmp_path, monkeypatch):
    from lmforge.components.registry import claim as claims
    from lmforge.components.tracking import use_workspace
    from lmforge.components.workspace import Workspace

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "ws-B"))
    monkeypatch.setenv("LMFORGE_ACTOR", "B")
    monkeypatch.setattr(claims, "CLAIM_TTL_S", TTL_S)
    ws = Workspace(tmp_path / "ws-B").ensure()
    use_workspace(ws)
    return ws


def test_a_holder_paused_between_its_check_and_its_write_adds_its_record_and_erases_none(ws_b, tmp_path):
    """Done when (issue 44): the paused holder's late write lands (the check-then-act window), but the trail is
    append-only, so it holds both holders' records, and the alias is the second holder's."""
    from mlflow import MlflowClient

    from lmforge.components.registry import current, history, set_alias
    from lmforge.components.registry.audit import AuditLog

    model, client = "lease-window", MlflowClient()
    v1, v2, v3 = _versions(client, model, 3)
    set_alias(ws_b, model, "champion", v1, reason="start", expect=None)
    env = {"LMFORGE_HOME": str(tmp_path / "ws-A"), "LMFORGE_ACTOR": "A"}
    # stopped after its claim check passed, before the pending record it guards is written
    child = _start([MOVER, model, v1, v2, "verify", "as pending", str(TTL_S)], env, REPO)
    set_alias(ws_b, model, "champion", v3, reason="second holder", expect=v1)   # breaks A's claim after the ttl
    out, err = _finish(child)

    assert child.returncode == LOST, (out, err[-3000:])
    assert current(ws_b, model, "champion") == v3
    lines = AuditLog(client, ws_b, model).lines()
    mine = [(x["who"], x["to_version"], x["state"]) for x in lines]
    assert ("B", v3, "done") in mine and ("B", v1, "done") in mine     # nothing of B's was erased
    assert ("A", v2, "pending") in mine and ("A", v2, "lost") in mine  # A's late write and its word that it lost
    assert [(m.to_version, m.why) for m in history(ws_b, model, alias="champion")] == [
        (v1, "start"), (v3, "second holder")]                         # A's pending move settled: aborted
    assert [x["state"] for x in AuditLog(client, ws_b, model).lines() if x["who"] == "A"] == [
        "pending", "lost", "aborted"]


def test_a_guard_left_by_a_killed_breaker_is_taken_over_after_its_ttl(ws_b, monkeypatch):
    """Done when (issue 44): no hand work; the takeovers (the guard, then the dead claim) are in the trail."""
    from mlflow import MlflowClient

    from lmforge.components.registry import claim as claims
    from lmforge.components.registry import current, set_alias
    from lmforge.components.registry.aliases import audit_trail

    model, client = "lease-guard", MlflowClient()
    (v1,) = _versions(client, model, 1)
    client.create_registered_model(claims.claim_name(model), tags={
        claims.TOKEN: "gone", claims.HOST: "another-host", claims.PID: "1", claims.WHO: "vanished-mover"})
    breaker = _start([BREAKER, model, str(TTL_S)], {"LMFORGE_ACTOR": "killed-breaker"}, REPO)
    breaker.kill()   # SIGKILL while it holds the break guard: nothing of it runs again
    breaker.wait()
    guard = claims.guard_name(model, "gone")
    assert client.get_registered_model(guard).tags[claims.WHO] == "killed-breaker"

    monkeypatch.setattr(claims, "WAIT_S", 30.0)   # before the lease, this waited for ever (here: failed at 30 s)
    start = time.monotonic()
    set_alias(ws_b, model, "champion", v1, reason="after the killed breaker", expect=None)
    assert time.monotonic() - start >= TTL_S
    assert current(ws_b, model, "champion") == v1
    assert claims.leftover_claims(client) == []
    _, lines = audit_trail(ws_b, model)
    leases = [(x["action"], x["state"]) for x in lines if x["state"] == "lease"]
    assert leases == [("take-over-guard", "lease"), ("take-over-claim", "lease")]
    assert "killed-breaker" in next(x["why"] for x in lines if x["action"] == "take-over-guard")


def _pg_setup(pg, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from lmforge.components.registry import claim as claims
    from lmforge.components.tracking import use_workspace
    from lmforge.components.workspace import Workspace

    uri = pg.create_database("mlflow")
    monkeypatch.chdir(tmp_path)          # the store's default artifact root, ./mlruns, is under tmp_path
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "ws-B"))
    monkeypatch.setenv("LMFORGE_ACTOR", "B")
    monkeypatch.setattr(claims, "CLAIM_TTL_S", TTL_S)
    ws = Workspace(tmp_path / "ws-B").ensure()
    use_workspace(ws)
    return ws, MlflowClient(tracking_uri=uri, registry_uri=uri)


def test_on_postgresql_a_paused_holder_is_refused_by_the_database_lock(tmp_path, monkeypatch):
    """Done when (issue 44): the holder stops between two writes; the server ends its silent session, which frees the
    advisory lock; the next mover takes the lease at once and moves; the resumed holder's write is refused by the
    database (its session is gone), not by a tag it read."""
    from lmforge.components.registry import current, history, set_alias
    from lmforge.components.registry.audit import AuditLog
    from tests.integration.servers import postgres

    with postgres(tmp_path) as pg:
        ws, client = _pg_setup(pg, tmp_path, monkeypatch)
        v1, v2, v3 = _versions(client, "pg-lease", 3)
        set_alias(ws, "pg-lease", "champion", v1, reason="start", expect=None)
        env = {"LMFORGE_HOME": str(tmp_path / "ws-A"), "LMFORGE_ACTOR": "A"}
        # stopped after its pending record was written (the fence committed), before the move
        child = _start([MOVER, "pg-lease", v1, v2, "append", "'state': 'pending'", str(TTL_S)], env, tmp_path)
        set_alias(ws, "pg-lease", "champion", v3, reason="second holder", expect=v1)
        out, err = _finish(child)

        assert child.returncode == LOST, (out, err[-3000:])
        assert "the server ended its database lock's session" in out, out
        assert current(ws, "pg-lease", "champion") == v3
        assert [m.to_version for m in history(ws, "pg-lease", alias="champion")] == [v1, v3]
        lines = AuditLog(client, ws, "pg-lease").lines()
        assert [(x["action"], x["state"]) for x in lines if x["state"] == "lease"] == [("take-over-claim", "lease")]


def test_on_postgresql_a_holder_paused_inside_its_write_keeps_the_lock_and_no_one_moves_past_it(tmp_path, monkeypatch):
    """The window the claim alone cannot close: the holder passed its check and stops before the alias write. Its
    session is inside a transaction, which the server does not time out, so the lock stays its own and the next
    mover is refused (naming the holder's session) instead of breaking it; resumed, the holder's move is the only
    one. Without the lock the next mover would break it after the ttl and the resumed holder overwrite its move."""
    from lmforge.components.errors import UserError
    from lmforge.components.registry import claim as claims
    from lmforge.components.registry import current, history, set_alias
    from tests.integration.servers import postgres

    with postgres(tmp_path) as pg:
        ws, client = _pg_setup(pg, tmp_path, monkeypatch)
        v1, v2, v3 = _versions(client, "pg-window", 3)
        set_alias(ws, "pg-window", "champion", v1, reason="start", expect=None)
        env = {"LMFORGE_HOME": str(tmp_path / "ws-A"), "LMFORGE_ACTOR": "A"}
        child = _start([MOVER, "pg-window", v1, v2, "verify", "move pg-window@champion", str(TTL_S)], env, tmp_path)
        monkeypatch.setattr(claims, "WAIT_S", 3 * TTL_S)
        with pytest.raises(UserError, match=r"whose database lock \(session lmforge lease A pid"):
            set_alias(ws, "pg-window", "champion", v3, reason="second holder", expect=v1)
        assert current(ws, "pg-window", "champion") == v1
        out, err = _finish(child)

        assert child.returncode == 0 and "moved" in out, (out, err[-3000:])
        assert current(ws, "pg-window", "champion") == v2
        assert [m.to_version for m in history(ws, "pg-window", alias="champion")] == [v1, v2]
