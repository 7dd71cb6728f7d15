"""A local Prefect server and process worker on loopback, for `lmforge prefect up/down`; each command's temporary server.

    server = start_server(ws, port=4200)       # `prefect server start`, detached, waits for /api/health
    start_worker(ws, server.api_url)           # `prefect worker start --pool lmforge-process`
    deploy_all(ws, server.api_url)             # `prefect deploy --all --prefect-file <packaged prefect.yaml>`
    stop_all(ws)                               # both, by the records (pid + start time) in <ws>/prefect/

The server keeps its database in the workspace (<ws>/prefect), the same one the
embedded mode uses, so flow runs made before `up` show in its UI. While it is up,
`lmforge` commands send their runs to it (see `active_api_url`); the plain `prefect`
CLI needs `PREFECT_API_URL`, which `up` prints. Processes are started, waited for,
recognised and stopped by the shared lifecycle in components/runtime/service.py (the same one
tritonserver uses): a recorded pid that now belongs to another process is treated as
gone, never signalled. Only the command lines, the environment and the health URL are
Prefect's.

Without `up` (the embedded mode), each `lmforge run` has a temporary server of its own, as Prefect
would start one, but started by the CLI before it imports its flows so that it gets ready meanwhile:

    server = start_temporary(ws, mode)         # Prefect's API app on a free port; PREFECT_API_URL names it
    server.wait()                              # before the first flow (cli/work.py `the_work`); stopped at exit
"""

from __future__ import annotations

import atexit
import os
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.runtime import service, supervisor
from lmforge.components.runtime.machine import machine_cache_dir
from lmforge.components.runtime.ports import free_port
from lmforge.components.runtime.resources import prefect_yaml
from lmforge.components.workspace import Workspace
from lmforge.flows import prefect_env

WORK_POOL = "lmforge-process"
STATE_FILE = prefect_env.SERVER_STATE
WORKER_FILE = "worker.json"
TEMPORARY_LOG = "temporary-server.log"   # <ws>/prefect/<this>: the output of each command's temporary server
DATABASE = "prefect.db"                  # Prefect's database under PREFECT_HOME (its default connection URL)


@dataclass(frozen=True)
class ServerInfo(supervisor.HoldsProcess):
    api_url: str
    ui_url: str
    process: supervisor.ProcessRecord   # pid and start time: what names the server's process


def prefect_bin() -> str:
    return str(Path(sys.executable).with_name("prefect"))


def server_env(ws: Workspace, api_url: str | None = None) -> dict[str, str]:
    env = dict(os.environ, **prefect_env.embedded_env(ws), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               LMFORGE_HOME=str(ws.root))
    env.pop("PREFECT_API_URL", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def _service(ws: Workspace, port: int) -> service.Service:
    """The Prefect server as the shared lifecycle (components/runtime/service.py) sees it: command, environment, health URL."""
    api_url = f"http://127.0.0.1:{port}/api"
    return service.Service("prefect server", [prefect_bin(), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                           log=ws.prefect / "server.log", env=server_env(ws), ready=service.http_ok(f"{api_url}/health"),
                           address=api_url)


def start_server(ws: Workspace, *, port: int = 4200, timeout: float = 120) -> ServerInfo:
    """The workspace's running server, or a new one, healthy within `timeout` s (else stopped again, UserError)."""
    existing = active_server(ws)
    if existing is not None:
        return existing
    svc = _service(ws, port)
    rec = service.start(svc, timeout=timeout)
    info = ServerInfo(api_url=svc.address, ui_url=f"http://127.0.0.1:{port}", process=rec)
    service.save_state(ws.prefect / STATE_FILE, rec, api_url=info.api_url, ui_url=info.ui_url)
    return info


def prefect_cli(ws: Workspace, api_url: str, *args: str, check: bool = True,
                cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`prefect <args>` against `api_url`; its output goes to <ws>/prefect/cli.log. A failure (with `check`)
    raises one line: the command, its exit code, its last line and where the rest is."""
    done = subprocess.run([prefect_bin(), *args], cwd=cwd, env=server_env(ws, api_url), capture_output=True, text=True)
    log = ws.prefect / "cli.log"
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"$ prefect {' '.join(args)}  (exit {done.returncode})\n{done.stdout}{done.stderr}\n")
    if check and done.returncode != 0:
        last = next((line.strip() for line in reversed((done.stdout + done.stderr).splitlines()) if line.strip()), "")
        raise RuntimeError(f"`prefect {' '.join(args[:3])}` failed with exit code {done.returncode}: {last} "
                           f"(full output: {log})")
    return done


def ensure_work_pool(ws: Workspace, api_url: str) -> None:
    if prefect_cli(ws, api_url, "work-pool", "inspect", WORK_POOL, check=False).returncode == 0:
        return
    prefect_cli(ws, api_url, "work-pool", "create", WORK_POOL, "--type", "process")


def start_worker(ws: Workspace, api_url: str) -> int:
    """A process worker for the lmforge pool; flow runs start in the workspace with this Python."""
    ensure_work_pool(ws, api_url)
    running, _ = service.running(ws.prefect / WORKER_FILE)
    if running is not None:
        return running.pid
    env = server_env(ws, api_url)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    rec = service.launch(service.Service("prefect worker", [prefect_bin(), "worker", "start", "--pool", WORK_POOL,
                                                            "--name", "lmforge-local"],
                                         log=ws.prefect / "worker.log", env=env, cwd=ws.root))
    service.save_state(ws.prefect / WORKER_FILE, rec)
    return rec.pid


def deploy_all(ws: Workspace, api_url: str) -> str:
    """`prefect deploy --all` of the packaged prefect.yaml (module entrypoints), run from the workspace."""
    ensure_work_pool(ws, api_url)
    return prefect_cli(ws, api_url, "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_yaml()),
                       cwd=ws.root).stdout


def active_server(ws: Workspace) -> ServerInfo | None:
    """The server `up` started for this workspace, if that very process is still running."""
    rec, data = service.running(ws.prefect / STATE_FILE)
    if rec is None:
        return None
    return ServerInfo(api_url=data["api_url"], ui_url=data["ui_url"], process=rec)


def active_api_url(ws: Workspace) -> str | None:
    return prefect_env.workspace_server_url(ws)


def stop_worker(ws: Workspace) -> bool:
    return service.stop_recorded(ws.prefect / WORKER_FILE)


def stop_server(ws: Workspace) -> bool:
    return service.stop_recorded(ws.prefect / STATE_FILE)


def stop_all(ws: Workspace) -> list[str]:
    """Stop the worker, then the server; the names of those that were running."""
    return [name for name, stop in (("worker", stop_worker), ("server", stop_server)) if stop(ws)]


def require_server(ws: Workspace) -> ServerInfo:
    info = active_server(ws)
    if info is None:
        raise UserError("prefect server", None, "is not running for this workspace", "Start it with: lmforge prefect up")
    return info


# --- the temporary server of one command -----------------------------------------------------------------------

def temporary_app() -> Any:
    """uvicorn's factory for the temporary server: Prefect's API app as Prefect builds it for its own temporary
    server (`ephemeral`: no UI, and only the services an ephemeral server runs)."""
    from prefect.server.api.server import create_app

    return create_app(ephemeral=True, final=True)


@dataclass
class TemporaryServer:
    """The temporary Prefect server of one command: started early, waited for before the first flow, stopped at exit."""
    svc: service.Service
    rec: supervisor.ProcessRecord
    timeout: float
    ready: bool = field(default=False)
    new_database: Path | None = None   # the workspace's database, when this server created (migrated) it

    @property
    def api_url(self) -> str:
        return self.svc.address

    def wait(self) -> None:
        """Block until it answers (once); ServiceNotReady, with its log's tail, if it exits or `timeout` s pass."""
        if not self.ready:
            try:
                service.wait_ready(self.svc, self.rec, timeout=self.timeout)
            except BaseException:   # Ctrl-C included: nothing half-started is left behind
                self.stop()
                raise
            self.ready = True
            if self.new_database is not None:
                save_database_template(self.new_database)

    def stop(self) -> None:
        service.stop(self.rec, group=True)


def start_temporary(ws: Workspace, mode: prefect_env.PrefectMode) -> TemporaryServer | None:
    """Start the embedded mode's temporary API server now, without waiting for it; None when Prefect would not start one.

    Prefect starts its temporary server at the first API call and waits for it there (seconds of imports, and a
    migration on a new database) while the command does nothing else. Started here, before the command imports
    its flows, it gets ready meanwhile on the other core. It is Prefect's own app (`temporary_app`), over the
    workspace's database, on a free loopback port that PREFECT_API_URL names from now on for this process and its
    children; so this must run before `prefect` is imported, which reads its settings once. (The port is free when
    chosen and bound by the server seconds later, as with Prefect's own; taken meanwhile, the server exits and the
    wait says so, with its log.) It lives in this command's session, in a process group of its own (Ctrl-C in
    the terminal reaches the command, which stops it): stopped at exit (`atexit`, after Prefect's own exit
    handlers, which still talk to it), and by the CLI's reaper after a signal. Nothing here outlives the command,
    as Prefect's own temporary server did not.
    """
    if mode.kind != "embedded" or os.environ.get("PREFECT_API_URL") or "prefect" in sys.modules:
        return None
    prefect_env.prepare(mode)
    database = ws.prefect / DATABASE
    new = not database.exists() and not seed_database(database)
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = dict(server_env(ws), PREFECT_SERVER_UI_ENABLED="false")
    svc = service.Service("prefect temporary server",
                          [sys.executable, "-m", "uvicorn", "--factory", f"{__name__}:temporary_app", "--host",
                           "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"],
                          log=ws.prefect / TEMPORARY_LOG, env=env, ready=service.http_ok(f"{api_url}/health"),
                          address=api_url, own_session=False,
                          timeout_fix="set PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS higher")
    timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
                    or prefect_env.DEFAULTS["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"])
    server = TemporaryServer(svc, service.launch(svc), timeout, new_database=database if new else None)
    atexit.register(server.stop)   # registered before `import prefect`: runs after Prefect's own exit handlers
    os.environ["PREFECT_API_URL"] = os.environ[prefect_env.TEMPORARY_URL_VAR] = api_url
    return server


# --- a new workspace's database, migrated once per machine ------------------------------------------------------

def database_template() -> Path:
    """The machine's migrated, empty Prefect database for this Prefect version (a new version migrates anew)."""
    return machine_cache_dir() / f"prefect-{metadata.version('prefect')}.db"


def seed_database(database: Path) -> bool:
    """Give a new workspace the machine's migrated, empty database, when there is one: Prefect then skips its
    migrations (114 in Prefect 3.8.8, ~4-5 s on 2 cores) and the first command of a workspace starts as fast as the
    next. Copied whole under a temporary name, then renamed into place. True when seeded."""
    template = database_template()
    if database.exists() or not template.is_file():
        return False
    partial = database.with_name(f".{database.name}.{os.getpid()}")
    shutil.copyfile(template, partial)
    os.replace(partial, database)
    return True


def save_database_template(database: Path) -> None:
    """Keep a copy of a database the temporary server has just migrated, before any flow has run in it: SQLite's
    backup (a consistent snapshot, also while the server holds it), renamed into place; nothing on failure (the
    next new workspace migrates, as before)."""
    template = database_template()
    if template.exists():
        return
    partial = template.with_name(f".{template.name}.{os.getpid()}")
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        src, dst = sqlite3.connect(database), sqlite3.connect(partial)
        try:
            src.backup(dst)
        finally:
            src.close()
            dst.close()
        os.replace(partial, template)
    except (OSError, sqlite3.Error):
        partial.unlink(missing_ok=True)
