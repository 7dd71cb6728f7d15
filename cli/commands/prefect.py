"""`lmforge prefect up|deploy|down|status`: a local Prefect server, the deployments and a worker.

    lmforge prefect up            # server on 127.0.0.1:4200 + a process worker for the lmforge pool
    lmforge prefect deploy        # prefect deploy --all (prefect.yaml at the repo root)
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    prefect deployment ls         # the plain prefect CLI, as usual
    prefect deployment run 'pipeline/nightly'
    lmforge prefect status [--json] # the workspace's server, and which Prefect lmforge runs report to
    lmforge prefect down
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from lmforge.cli.commands import JsonOpt
from lmforge.cli.output import emit_json, json_mode
from lmforge.components.workspace import Workspace
from lmforge.flows import prefect_env, prefect_local

app = typer.Typer(no_args_is_help=True, help="A local Prefect server, deployments and a worker, on loopback.")
console = Console()


@app.command()
def up(port: Annotated[int, typer.Option(help="port on 127.0.0.1")] = 4200,
       worker: Annotated[bool, typer.Option(help="also start a process worker")] = True,
       as_json: JsonOpt = False) -> None:
    """Start the Prefect server (and a worker) for this workspace, in the background."""
    ws = Workspace.from_env().ensure()
    with json_mode(as_json):
        info = prefect_local.start_server(ws, port=port)
        pid = prefect_local.start_worker(ws, info.api_url) if worker else None
    if as_json:
        emit_json({"api_url": info.api_url, "ui_url": info.ui_url, "server_pid": info.pid, "worker_pid": pid,
                   "work_pool": prefect_local.WORK_POOL})
        return
    console.print(f"Prefect server: {info.ui_url}  (API {info.api_url}, pid {info.pid}, log {ws.prefect / 'server.log'})")
    if pid is not None:
        console.print(f"worker for pool {prefect_local.WORK_POOL}: pid {pid} (log {ws.prefect / 'worker.log'})")
    console.print(f"For the plain prefect CLI:  export PREFECT_API_URL={info.api_url}")
    console.print("lmforge commands in this workspace now send their runs to this server.")


@app.command()
def deploy() -> None:
    """Register every deployment in prefect.yaml (prefect deploy --all) with the running server."""
    ws = Workspace.from_env()
    info = prefect_local.require_server(ws)
    out = prefect_local.deploy_all(ws, info.api_url)
    console.print(out.strip()[-4000:])
    console.print(f"\nList them: PREFECT_API_URL={info.api_url} prefect deployment ls")


@app.command()
def down(as_json: JsonOpt = False) -> None:
    """Stop the worker and the server started by `up`."""
    stopped = prefect_local.stop_all(Workspace.from_env())
    if as_json:
        emit_json({"stopped": stopped})
        return
    console.print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@app.command()
def status(as_json: JsonOpt = False) -> None:
    """Whether the workspace's server is up, its URLs, and which Prefect lmforge runs report to."""
    ws = Workspace.from_env()
    info = prefect_local.active_server(ws)
    mode = prefect_env.choose(ws)
    if as_json:
        emit_json({"server": {"up": info is not None, **({"api_url": info.api_url, "ui_url": info.ui_url,
                                                         "pid": info.pid} if info else {})},
                   "runs_report_to": mode.to_dict()})
        return
    console.print(f"up: {info.ui_url} (API {info.api_url}, pid {info.pid})" if info else "down")
    console.print(mode.describe(), highlight=False)
