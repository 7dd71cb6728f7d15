"""A local Prefect server and process worker on loopback, for `lmforge prefect up/down`.

    server = start_server(ws, port=4200)       # `prefect server start`, detached, waits for /api/health
    start_worker(ws, server.api_url)           # `prefect worker start --pool lmforge-process`
    stop_all(ws)                               # both, by the pids recorded in <ws>/prefect/

The server keeps its database in the workspace (<ws>/prefect), the same one the
embedded mode uses, so flow runs made before `up` show in its UI. While it is up,
`lmforge` commands send their runs to it (see `active_api_url`); the plain `prefect`
CLI needs `PREFECT_API_URL`, which `up` prints.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from lmforge.components.errors import UserError
from lmforge.components.workspace import Workspace, atomic_write_json

WORK_POOL = "lmforge-process"
STATE_FILE = "server.json"


@dataclass(frozen=True)
class ServerInfo:
    api_url: str
    ui_url: str
    pid: int


def prefect_bin() -> str:
    return str(Path(sys.executable).with_name("prefect"))


def server_env(ws: Workspace, api_url: str | None = None) -> dict[str, str]:
    env = dict(os.environ, PREFECT_HOME=str(ws.prefect), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_LOCAL_STORAGE_PATH=str(ws.prefect / "storage"), LMFORGE_HOME=str(ws.root))
    env.pop("PREFECT_API_URL", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def wait_healthy(api_url: str, *, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Poll `<api>/health` until it answers 200; fail with the log's tail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"prefect server at {api_url} not healthy after {timeout:.0f}s:\n{_tail(log)}")


def start_server(ws: Workspace, *, port: int = 4200, timeout: float = 120) -> ServerInfo:
    existing = active_server(ws)
    if existing is not None:
        return existing
    ws.prefect.mkdir(parents=True, exist_ok=True)
    log = ws.prefect / "server.log"
    api_url = f"http://127.0.0.1:{port}/api"
    with open(log, "ab") as out:
        proc = subprocess.Popen([prefect_bin(), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                env=server_env(ws), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(api_url, timeout=timeout, proc=proc, log=log)
    except BaseException:
        _kill(proc.pid)
        raise
    info = ServerInfo(api_url=api_url, ui_url=f"http://127.0.0.1:{port}", pid=proc.pid)
    atomic_write_json(ws.prefect / STATE_FILE, info.__dict__)
    return info


def ensure_work_pool(ws: Workspace, api_url: str) -> None:
    env = server_env(ws, api_url)
    inspect = subprocess.run([prefect_bin(), "work-pool", "inspect", WORK_POOL], env=env, capture_output=True, text=True)
    if inspect.returncode == 0:
        return
    made = subprocess.run([prefect_bin(), "work-pool", "create", WORK_POOL, "--type", "process"],
                          env=env, capture_output=True, text=True)
    if made.returncode != 0:
        raise RuntimeError(f"could not create work pool {WORK_POOL}: {made.stdout}{made.stderr}")


def start_worker(ws: Workspace, api_url: str) -> int:
    """A process worker for the lmforge pool; flow runs start in the repo root with this Python."""
    ensure_work_pool(ws, api_url)
    pid_file = ws.prefect / "worker.pid"
    if pid_file.exists() and _alive(int(pid_file.read_text())):
        return int(pid_file.read_text())
    repo = Path(__file__).resolve().parent.parent
    env = server_env(ws, api_url)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    with open(ws.prefect / "worker.log", "ab") as out:
        proc = subprocess.Popen([prefect_bin(), "worker", "start", "--pool", WORK_POOL, "--name", "lmforge-local"],
                                env=env, cwd=repo, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    pid_file.write_text(str(proc.pid))
    return proc.pid


def deploy_all(ws: Workspace, api_url: str) -> str:
    """`prefect deploy --all` from the repo root, against the server."""
    ensure_work_pool(ws, api_url)
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([prefect_bin(), "--no-prompt", "deploy", "--all"], cwd=repo, env=server_env(ws, api_url),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"prefect deploy --all failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def active_server(ws: Workspace) -> ServerInfo | None:
    """The server `up` started for this workspace, if it is still running."""
    state = ws.prefect / STATE_FILE
    if not state.exists():
        return None
    info = ServerInfo(**json.loads(state.read_text()))
    return info if _alive(info.pid) else None


def active_api_url(ws: Workspace) -> str | None:
    info = active_server(ws)
    return info.api_url if info else None


def stop_worker(ws: Workspace) -> bool:
    pid_file = ws.prefect / "worker.pid"
    if not pid_file.exists():
        return False
    stopped = _kill(int(pid_file.read_text()))
    pid_file.unlink()
    return stopped


def stop_server(ws: Workspace) -> bool:
    state = ws.prefect / STATE_FILE
    if not state.exists():
        return False
    stopped = _kill(json.loads(state.read_text())["pid"])
    state.unlink()
    return stopped


def stop_all(ws: Workspace) -> list[str]:
    """Stop the worker, then the server; the names of those that were running."""
    return [name for name, stop in (("worker", stop_worker), ("server", stop_server)) if stop(ws)]


def require_server(ws: Workspace) -> ServerInfo:
    info = active_server(ws)
    if info is None:
        raise UserError("prefect server", None, "is not running for this workspace", "Start it with: lmforge prefect up")
    return info


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill(pid: int, grace: float = 10) -> bool:
    """SIGTERM the process group, then SIGKILL after `grace` seconds; True if it was running."""
    if not _alive(pid):
        return False
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive(pid):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.2)
    if _alive(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return True


def _tail(log: Path | None, n: int = 30) -> str:
    if log is None or not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
