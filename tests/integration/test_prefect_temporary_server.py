"""The embedded mode's temporary Prefect server: started by the command before it imports its flows, gone with it.

`lmforge run` starts Prefect's API app (flows/prefect_local.py `start_temporary`) while it imports, instead of
letting Prefect start it at the first API call, and waits for it before the first flow. These tests hold it to
what Prefect's own temporary server guaranteed: the runs land in the workspace's database, nothing of it
outlives the command, and a user's own Prefect is left alone.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

from lmforge.components.workspace import Workspace
from lmforge.flows import prefect_env, prefect_local
from tests.conftest import REPO, TINY_CONFIG

pytestmark = [pytest.mark.integration]

PREFECT_VARS = ("PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH", "PREFECT_API_URL", "PREFECT_PROFILE")

# In a fresh interpreter, as the CLI does it: start, import Prefect meanwhile, wait, ask the server, exit.
START_AND_EXIT = """
import json, os, sys, time
from lmforge.components.workspace import Workspace
from lmforge.flows import prefect_env, prefect_local
t0 = time.perf_counter()
server = prefect_local.start_temporary(Workspace.from_env(), prefect_env.activate())
assert "prefect" not in sys.modules
from prefect.client.orchestration import get_client
server.wait()
ready = time.perf_counter() - t0
with get_client(sync_client=True) as client:
    assert str(client.api_url).rstrip("/") == server.api_url == os.environ["PREFECT_API_URL"]
    client.hello()
assert prefect_env.is_temporary(server.api_url)   # the monitor's retrain runs here, not as a deployment on it
print(json.dumps({"pid": server.rec.pid, "create_time": server.rec.create_time, "ready_s": round(ready, 2),
                  "migrated": server.new_database is not None}))
"""


def clean_env(home: Path) -> dict[str, str]:
    env = {**os.environ, "LMFORGE_HOME": str(home), "HOME": str(home.parent / "home")}
    for var in PREFECT_VARS:
        env.pop(var, None)   # the workspace's own embedded Prefect, not the test session's or the user's
    return env


def processes_with(marker: bytes) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def test_started_before_prefect_is_imported_and_stopped_at_exit(tmp_path):
    """On a new database (migrations) and again on the same one: ready, answering, then gone with the process."""
    from lmforge.components.runtime import supervisor

    home = tmp_path / "ws"
    for db in ("new", "existing"):
        r = subprocess.run([sys.executable, "-c", START_AND_EXIT], env=clean_env(home), capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        rec = supervisor.ProcessRecord(pid=out["pid"], create_time=out["create_time"], pgid=out["pid"])
        assert not supervisor.alive(rec), f"the temporary server outlived its command ({db} database)"
        print(f"temporary server ready in {out['ready_s']} s on a {db} database")
    assert (home / "prefect" / "prefect.db").is_file()          # the workspace's database, as before
    assert (home / "prefect" / prefect_local.TEMPORARY_LOG).is_file()


def test_a_data_run_reports_to_it_and_leaves_no_process(tmp_path):
    home = tmp_path / "ws"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": f"Document {i} says {i * 7} things about "
                                                                 f"topic {i % 5} in a sentence or two."}) + "\n"
                              for i in range(40)))
    r = subprocess.run([sys.executable, "-m", "lmforge.cli", "run", "data", "-c", str(TINY_CONFIG),
                        "--set", f"data.source={corpus}", "--set", "task.kind=completion"],
                       cwd=REPO, env=clean_env(home), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "prefect: embedded home" in r.stderr
    with sqlite3.connect(home / "prefect" / "prefect.db") as db:
        states = {name: state for name, state in db.execute(
            "SELECT flow.name, flow_run.state_type FROM flow_run JOIN flow ON flow.id = flow_run.flow_id")}
    assert states.get("data") == "COMPLETED", states
    deadline = time.monotonic() + 10
    while (left := processes_with(f"LMFORGE_HOME={home}".encode())) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"left behind by a finished run: {left}"


@pytest.mark.parametrize("env", [{"PREFECT_API_URL": "http://127.0.0.1:1/api"}, {"PREFECT_HOME": "mine"}])
def test_a_users_own_prefect_gets_no_temporary_server(tmp_path, env):
    ws = Workspace(tmp_path / "ws")
    mode = prefect_env.choose(ws, {"HOME": str(tmp_path / "home"), **env})
    assert mode.kind != "embedded"
    assert prefect_local.start_temporary(ws, mode) is None
    assert not (tmp_path / "ws" / "prefect").exists()


def test_none_once_prefect_has_read_its_settings(tmp_path):
    """Prefect reads PREFECT_API_URL once, at import: after that, Prefect starts its own server as it always did."""
    ws = Workspace(tmp_path / "ws")
    mode = prefect_env.choose(ws, {"HOME": str(tmp_path / "home")})
    assert mode.kind == "embedded"
    import prefect  # noqa: F401  (this test process has imported it; a CLI command has not, at start_work)

    assert prefect_local.start_temporary(ws, mode) is None


def test_a_process_that_lives_with_its_caller_is_in_its_session_and_a_group_of_its_own(tmp_path):
    """`own_session=False` (the temporary server): the CLI's reaper, which works by session, finds it; Ctrl-C in
    the terminal, sent to the foreground group, does not reach it (the command stops it when it unwinds)."""
    from lmforge.components.runtime import supervisor

    rec = supervisor.start([sys.executable, "-c", "import time; time.sleep(60)"], log=tmp_path / "log",
                           own_session=False)
    try:
        assert os.getsid(rec.pid) == os.getsid(0)
        assert rec.pgid == rec.pid != os.getpgid(0)
    finally:
        assert supervisor.stop(rec, grace=5)
    assert not supervisor.alive(rec)


def test_only_the_commands_own_temporary_server_is_temporary(monkeypatch):
    """The drift loop starts a retrain deployment on a configured server and the retrain flow here otherwise: a
    command's temporary server, though PREFECT_API_URL names it, is the latter (flows/monitor.py)."""
    monkeypatch.setenv(prefect_env.TEMPORARY_URL_VAR, "http://127.0.0.1:5555/api")
    assert prefect_env.is_temporary("http://127.0.0.1:5555/api")
    assert not prefect_env.is_temporary("http://127.0.0.1:4200/api")   # `lmforge prefect up`'s, or a user's
    assert not prefect_env.is_temporary(None)
    monkeypatch.delenv(prefect_env.TEMPORARY_URL_VAR)
    assert not prefect_env.is_temporary("http://127.0.0.1:5555/api")


def test_a_new_workspace_starts_from_the_machines_migrated_database(tmp_path):
    """The first new workspace on a machine migrates Prefect's database and leaves an empty copy in the machine's
    cache; the next new workspace starts from that copy (no migrations) and its server answers as the first's did."""
    cache = tmp_path / "cache"
    runs = {}
    for name in ("first", "second"):
        env = {**clean_env(tmp_path / name), "LMFORGE_CACHE_DIR": str(cache)}
        r = subprocess.run([sys.executable, "-c", START_AND_EXIT], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{name} new workspace: temporary server ready in {runs[name]['ready_s']} s")
    assert runs["first"]["migrated"] and not runs["second"]["migrated"]
    template = cache / f"prefect-{metadata.version('prefect')}.db"
    with sqlite3.connect(template) as db:
        assert db.execute("SELECT count(*) FROM flow_run").fetchone() == (0,)      # empty: no run of the first's
        assert db.execute("SELECT count(*) FROM block_type").fetchone()[0] > 0     # migrated and registered
    assert str(tmp_path / "first").encode() not in template.read_bytes()           # nothing of the first workspace


def test_seeding_never_replaces_a_database_and_the_first_template_stays(tmp_path, monkeypatch):
    monkeypatch.setenv("LMFORGE_CACHE_DIR", str(tmp_path / "cache"))
    made = tmp_path / "made.db"
    with sqlite3.connect(made) as db:
        db.execute("CREATE TABLE t (x)")
    prefect_local.save_database_template(made)
    template = prefect_local.database_template()
    first = template.read_bytes()
    with sqlite3.connect(made) as db:
        db.execute("CREATE TABLE u (y)")
    prefect_local.save_database_template(made)
    assert template.read_bytes() == first                                         # kept, not overwritten
    existing = tmp_path / "ws" / "prefect.db"
    existing.parent.mkdir()
    existing.write_bytes(b"a workspace's own")
    assert not prefect_local.seed_database(existing) and existing.read_bytes() == b"a workspace's own"
    fresh = tmp_path / "ws2" / "prefect.db"
    fresh.parent.mkdir()
    assert prefect_local.seed_database(fresh) and fresh.read_bytes() == first
    assert [p.name for p in fresh.parent.iterdir()] == ["prefect.db"]             # no partial copy left
