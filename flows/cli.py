"""The `lmforge` command line.

    lmforge run data|features|train|evaluate|compress|deploy|monitor|all [--config F] [--set k=v ...]
    lmforge status                      # datasets, training runs, models and aliases, deployments
    lmforge ui mlflow [--port 5000]     # the MLflow UI on the workspace's store, on loopback

A user error prints one line, `error: ...`, and exits 2; `--debug` shows the traceback.
Other command groups (plan, registry, serve, deploy, monitor, prefect) live in
`flows/commands/` and are mounted here.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from lmforge.components.errors import UserError
from lmforge.components.workspace import Workspace

console = Console()
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="lmforge: raw text to a monitored model behind Triton, as Prefect flows.")
ui_app = typer.Typer(no_args_is_help=True, help="Open the web UIs on loopback.")
app.add_typer(ui_app, name="ui")

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="pipeline TOML (default configs/demo.toml)")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="override: section.key=value (repeatable)")]

# Command groups defined in flows/commands/<name>.py, each exposing `app` (a typer.Typer,
# mounted as `lmforge <name> ...`) or `register(app)` (adds top-level commands).
COMMAND_GROUPS: list[str] = ["plan", "registry", "serve", "monitor", "prefect"]

_state = {"debug": False}


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False) -> None:
    _state["debug"] = debug


def load(config: Path | None, overrides: list[str] | None) -> Any:
    from lmforge.components.config import load_config

    return load_config(config, overrides or [])


@app.command()
def run(
    stage: Annotated[str, typer.Argument(help="a stage name, or 'all' for the whole pipeline")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="training: continue from the last complete checkpoint")] = False,
) -> None:
    """Run one stage, or `all` of them in order."""
    from lmforge.flows.pipeline import available_stages, pipeline_flow, stage_flow

    cfg = load(config, set_)
    stages = available_stages()
    if stage in ("data", "all"):
        from lmforge.components.data.ingest import check_source

        check_source(cfg.data.source)  # fail in one line before Prefect starts, not in a flow run's log
    from lmforge.flows.summary import headline, print_run_summary

    if stage == "all":
        result = pipeline_flow(cfg, resume=resume)
        print_run_summary(result, console, ws=Workspace.from_env(), model_name=cfg.registry.model_name)
        return
    if stage not in stages:
        raise UserError("stage", stage, "is not a stage", f"Choose one of: {', '.join(stages)}, all")
    kwargs = {"resume": resume} if stage == "train" else {}
    result = stage_flow(stage)(cfg, **kwargs)
    console.print(f"[bold]{stage}[/bold]: {headline(stage, result)}")


@app.command()
def status() -> None:
    """What the workspace holds: datasets, training runs, models and aliases, deployments."""
    from lmforge.flows.status import render_status

    render_status(Workspace.from_env(), console)


@ui_app.command("mlflow")
def ui_mlflow(port: Annotated[int, typer.Option(help="port on 127.0.0.1")] = 5000) -> None:
    """Serve the MLflow UI for the workspace's tracking store and registry."""
    ws = Workspace.from_env().ensure()
    console.print(f"MLflow UI: http://127.0.0.1:{port}  (store {ws.mlflow_uri}; Ctrl-C to stop)")
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", ws.mlflow_uri,
           "--default-artifact-root", ws.mlflow_artifacts.as_uri(), "--host", "127.0.0.1", "--port", str(port)]
    raise typer.Exit(subprocess.call(cmd))


@ui_app.command("prefect")
def ui_prefect(port: Annotated[int, typer.Option(help="port on 127.0.0.1")] = 4200) -> None:
    """The Prefect UI: the server `lmforge prefect up` started, or a server in the foreground."""
    from lmforge.flows import prefect_local

    ws = Workspace.from_env().ensure()
    info = prefect_local.active_server(ws)
    if info is not None:
        console.print(f"Prefect UI: {info.ui_url}  (server started by `lmforge prefect up`, pid {info.pid})")
        return
    console.print(f"Prefect UI: http://127.0.0.1:{port}  (database in {ws.prefect}; Ctrl-C to stop)")
    cmd = [prefect_local.prefect_bin(), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    raise typer.Exit(subprocess.call(cmd, env=prefect_local.server_env(ws)))


def _mount_groups() -> None:
    for name in COMMAND_GROUPS:
        if importlib.util.find_spec(f"lmforge.flows.commands.{name}") is None:
            continue
        module = importlib.import_module(f"lmforge.flows.commands.{name}")
        if hasattr(module, "register"):
            module.register(app)
        else:
            app.add_typer(module.app, name=name)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning a UserError into one line and exit code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("LMFORGE_DEBUG") == "1"
    _mount_groups()
    try:
        # standalone mode: usage errors print click's message and exit 2, Ctrl-C exits 1
        app(args=argv, prog_name="lmforge", standalone_mode=True)
    except UserError as e:
        if debug:
            raise
        console.print(f"[red]error:[/red] {e}", soft_wrap=True, highlight=False)
        sys.exit(2)

if __name__ == "__main__":
    main()
