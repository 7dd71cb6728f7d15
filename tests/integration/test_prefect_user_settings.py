"""With PREFECT_API_URL set, `lmforge run data` reports to that server and writes no Prefect home of its own."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def flow_runs_since(server, flow_name: str, since: dt.datetime) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    async def read() -> list:
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])))
        return [r for r in runs if r.created and r.created >= since]

    with server.settings():
        return asyncio.run(read())


def test_run_data_reports_to_the_users_server(prefect_server, tmp_path):
    cwd = tmp_path / "empty"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LMFORGE_"))}
    env.update(PREFECT_API_URL=prefect_server.api_url, HOME=str(tmp_path / "home"))
    since = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=5)

    r = subprocess.run([sys.executable, "-m", "lmforge.cli", "run", "data", "--config", "tiny"], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"prefect: server {prefect_server.api_url} (PREFECT_API_URL)" in " ".join(r.stderr.split())

    runs = flow_runs_since(prefect_server, "data", since)
    assert [run.state.type.value for run in runs] == ["COMPLETED"], runs
    assert (cwd / ".lmforge" / "datasets").is_dir()          # the work ran here ...
    assert not (cwd / ".lmforge" / "prefect" / "prefect.db").exists()   # ... Prefect's state lives with its server,
    assert any((cwd / ".lmforge" / "prefect" / "storage").iterdir())    # the steps' results with the work,
    assert not (tmp_path / "home" / ".prefect").exists()                # and nothing goes to ~/.prefect


def test_an_active_profile_or_home_is_respected_and_only_then_embedded(tmp_path):
    from lmforge.components.workspace import Workspace
    from lmforge.flows.prefect_env import choose

    ws = Workspace(tmp_path / "ws")
    home = tmp_path / "home" / ".prefect"
    home.mkdir(parents=True)
    env = {"HOME": str(tmp_path / "home")}
    assert choose(ws, env).kind == "embedded"   # no settings at all

    (home / "profiles.toml").write_text('active = "ephemeral"\n[profiles.ephemeral]\n'
                                        'PREFECT_SERVER_ALLOW_EPHEMERAL_MODE = "true"\n')
    assert choose(ws, env).kind == "embedded"   # Prefect's default profile names no API

    (home / "profiles.toml").write_text('active = "cloud"\n[profiles.cloud]\n'
                                        'PREFECT_API_URL = "https://api.prefect.cloud/api/accounts/a/workspaces/w"\n'
                                        'PREFECT_API_KEY = "pnu_x"\n')
    mode = choose(ws, env)
    assert mode.kind == "profile" and "cloud" in mode.detail and mode.env == {} and not mode.embedded

    assert choose(ws, {**env, "PREFECT_HOME": str(tmp_path / "mine")}).kind == "home"
    assert choose(ws, {**env, "PREFECT_API_URL": "http://x/api"}).kind == "api_url"


def test_a_flow_called_from_python_in_an_empty_folder_makes_its_embedded_home(tmp_path):
    """No Prefect set up and no .lmforge yet: the flow creates <workspace>/prefect before Prefect's server needs it."""
    cwd = tmp_path / "empty"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LMFORGE_"))}
    env.update(HOME=str(tmp_path / "home"))
    script = ("from lmforge.flows.workspace_flow import workspace_flow\n"
              "@workspace_flow(name='probe')\n"
              "def probe(x: int) -> int:\n"
              "    return x + 1\n"
              "print('result', probe(41))\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "result 42" in r.stdout
    assert (cwd / ".lmforge" / "prefect" / "prefect.db").is_file()
    assert "Failed to create the Prefect home" not in r.stderr
