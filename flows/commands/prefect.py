"""`lmforge prefect up|deploy|down|status`: a local Prefect server, the deployments and a worker.

    lmforge prefect up            # server on 127.0.0.1:4200 + a process worker for the lmforge pool
    lmforge prefect deploy        # prefect deploy --all (prefect.yaml at the repo root)
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    prefect deployment ls         # the plain prefect CLI, as usual
    prefect deployment run 'pipeline/nightly'
    lmforge prefect down
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from lmforge.components.workspace import Workspace
from lmforge.flows import prefect_local

app = typer.Typer(no_args_is_help=True, help="A local Prefect server, deployments and a worker, on loopback.")
console = Console()


@app.command()
def up(port: Annotated[int, typer.Option(help="port on 127.0.0.1")] = 4200,
       worker: Annotated[bool, typer.Option(help="also start a process worker")] = True) -> None:
    """Start the Prefect server (and a worker) for this workspace, in the background."""
    ws = Workspace.from_env().ensure()
    info = prefect_local.start_server(ws, port=port)
    console.print(f"Prefect server: {info.ui_url}  (API {info.api_url}, pid {info.pid}, log {ws.prefect / 'server.log'})")
    if worker:
        pid = prefect_local.start_worker(ws, info.api_url)
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
def down() -> None:
    """Stop the worker and the server started by `up`."""
    stopped = prefect_local.stop_all(Workspace.from_env())
    console.print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@app.command()
def status() -> None:
    """Whether the server is up, and its URLs."""
    info = prefect_local.active_server(Workspace.from_env())
    console.print(f"up: {info.ui_url} (API {info.api_url}, pid {info.pid})" if info else "down")
