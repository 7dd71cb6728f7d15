"""The `lmforge` command line.

    lmforge run data|features|train|evaluate|compress|deploy|monitor|all [--config demo|tiny|F.toml] [--set k=v ...] [--json]
    lmforge status [--json]             # datasets, training runs, models and aliases, deployments
    lmforge ui mlflow [--port 5000]     # the MLflow UI of the registry the runs go to (a server's own, or on loopback)
    lmforge --version

Conventions, for every command:
- errors go to stderr as one line, `error: ...`; `--debug`, anywhere on the line, adds the traceback;
- exit codes: 0 ok, 1 the work failed, 2 a usage or configuration error (a bad option,
  config value or input: any UserError, wherever it is raised, before or during the work);
- `--json` prints one JSON document and nothing else on stdout (cli/output.py);
- quiet by default (flows/quiet.py); `-v`/`--verbose`, anywhere on the line, lets
  third-party progress bars, warnings and the training ranks' output through.

Command groups live in cli/commands/<name>.py, each exposing `app` (a typer.Typer,
mounted as `lmforge <name> ...`) or `register(app)` (adds top-level commands). Every
module there whose name does not start with "_" is mounted.
"""

from __future__ import annotations

import atexit
import enum
import gc
import importlib
import pkgutil
import signal
import subprocess
import sys
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from lmforge.cli import signals
from lmforge.cli.commands import ConfigOpt, JsonOpt, SetOpt
from lmforge.cli.output import emit_json, json_mode
from lmforge.cli.work import WorkFailed, one_line, start_work, the_work
from lmforge.components.errors import UserError
from lmforge.components.stages import STAGES
from lmforge.components.workspace import Workspace
from lmforge.flows import quiet

console = Console()
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="lmforge: raw text to a monitored model behind Triton, as Prefect flows.")
ui_app = typer.Typer(no_args_is_help=True, help="Open the web UIs on loopback.")
app.add_typer(ui_app, name="ui")

# The stages `lmforge run` takes, in pipeline order (components/stages.py, which imports nothing: no Prefect for --help).
Stage = enum.Enum("Stage", {name: name for name in (*STAGES, "all")}, type=str)  # choices in --help


# Global flags that may stand anywhere on the command line; main() takes them out before click parses.
DEBUG_FLAGS = ("--debug",)
VERBOSE_FLAGS = ("-v", "--verbose")


def package_version() -> str:
    try:
        return version("lmforge")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown"


def _version(value: bool) -> None:
    if value:
        print(f"lmforge {package_version()}")
        raise typer.Exit()


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks (anywhere on the line)")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v",
                                          help="show third-party progress bars, warnings and rank output")] = False,
    show_version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="print lmforge's version and exit")] = False,
) -> None:
    """Flags are read by main() wherever they stand; these declarations put them in --help."""


def load(config: Path | None, overrides: list[str] | None) -> Any:
    from lmforge.components.config import load_config

    return load_config(config, overrides or [])


@app.command()
def run(
    stage: Annotated[Stage, typer.Argument(help="a stage, or 'all' for the whole pipeline in order")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="training: continue from the last complete checkpoint")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run one stage, or `all` of them in order."""
    stage = stage.value
    cfg = load(config, set_)
    if stage in ("data", "all"):
        from lmforge.components.data.ingest import check_source

        check_source(cfg.data.source)  # fail in one line before Prefect starts, not in a flow run's log
    ws = Workspace.from_env()
    start_work(ws)
    from lmforge.cli.summary import headline, print_run_summary
    from lmforge.flows.pipeline import pipeline_flow, stage_flow

    with json_mode(as_json):
        with the_work():
            if stage == "all":
                result = pipeline_flow(cfg, resume=resume)
            else:
                result = stage_flow(stage)(cfg, **({"resume": resume} if stage == "train" else {}))
        if not as_json:
            if stage == "all":
                print_run_summary(result, console, ws=ws, model_name=cfg.registry.model_name)
            else:
                console.print(f"[bold]{stage}[/bold]: {headline(stage, result)}")
    if as_json:
        emit_json(result if stage == "all" else {"stage": stage, "result": result})


@app.command()
def status(as_json: JsonOpt = False) -> None:
    """What the workspace holds: datasets, training runs, models and aliases, deployments."""
    from lmforge.cli.status import render_status, status_dict

    ws = Workspace.from_env()
    if as_json:
        emit_json(status_dict(ws))
    else:
        render_status(ws, console)


@ui_app.command("mlflow")
def ui_mlflow(port: Annotated[int, typer.Option(help="port on 127.0.0.1")] = 5000) -> None:
    """The MLflow UI of the registry the runs go to: an MLflow server's own UI, else one served for the store."""
    from lmforge.components.tracking import is_server, registry_label, tracking_uri

    ws = Workspace.from_env()
    uri = tracking_uri(ws)
    if is_server(uri):   # MLFLOW_TRACKING_URI names a server: it serves its UI itself, with its registry
        console.print(f"MLflow UI: {uri.rstrip('/')}/#/models  ({registry_label(ws)})")
        return
    ws.ensure()
    console.print(f"MLflow UI: http://127.0.0.1:{port}  ({registry_label(ws)}; Ctrl-C to stop)")
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)]
    if uri == ws.mlflow_uri:   # another store keeps the artifact locations its experiments were made with
        cmd += ["--default-artifact-root", ws.mlflow_artifacts.as_uri()]
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


def command_modules() -> list[str]:
    """The modules under cli/commands/ to mount, by name (those not starting with "_")."""
    from lmforge.cli import commands

    return sorted(m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_"))


def _mount_groups() -> None:
    for name in command_modules():
        module = importlib.import_module(f"lmforge.cli.commands.{name}")
        if hasattr(module, "register"):
            module.register(app)
        elif hasattr(module, "app"):
            app.add_typer(module.app, name=name)


def _fail(e: BaseException, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exception(e, file=sys.stderr)
    print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
    return code


def run_cli(argv: list[str]) -> int:
    """Run the app on `argv`; the exit code (0 ok, 1 the work failed, 2 usage or configuration, 128 + N signal N)."""
    debug = any(a in DEBUG_FLAGS for a in argv)
    try:
        rc = _run(argv, debug=debug)
    except KeyboardInterrupt:    # one that came before or after click's handling of it
        rc = 130
    signum = signals.received()
    if signum is not None:       # SIGTERM or SIGINT (cli/signals.py); typer turns either into exit 130
        print(f"error: interrupted by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
        return 128 + signum
    return rc


def _run(argv: list[str], *, debug: bool) -> int:
    verbose = any(a in VERBOSE_FLAGS for a in argv)
    argv = [a for a in argv if a not in DEBUG_FLAGS + VERBOSE_FLAGS]
    quiet.configure(verbose=verbose or debug)
    if not debug:
        quiet.one_line_failures()
    try:
        _mount_groups()
        rc = app(args=argv, prog_name="lmforge", standalone_mode=False)
    except typer.Abort:                            # Ctrl-C at a prompt
        return 130
    except typer.TyperException as e:              # usage: unknown option, bad choice, missing argument
        if type(e).__name__ == "NoArgsIsHelpError":   # `lmforge plan` alone and the like: the help is the answer
            e.show(file=sys.stderr)  # type: ignore[attr-defined]
            return 2
        ctx = getattr(e, "ctx", None)
        where = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
        message = " ".join(e.format_message().split())
        print(f"error: {message}{where}", file=sys.stderr)
        return 2
    except UserError as e:
        return _fail(e, 2, debug)
    except WorkFailed as e:
        return _fail(e.__cause__ if debug and e.__cause__ else e, 1, debug)
    except Exception as e:  # a failure lmforge did not name: still one line, the traceback under --debug
        return _fail(e, 1, debug)
    return rc if isinstance(rc, int) else 0


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    signals.install()
    # Python's exit ends with a garbage collection over every object the command made or imported (Prefect, MLflow,
    # pyarrow, pydantic: 1-3 s on 2 cores) only to free memory the process hands back anyway. Frozen objects are
    # skipped. It runs after the exit handlers registered from here on and before those registered earlier (logging
    # flushes after it); what closes files, stops servers and flushes logs runs as before.
    atexit.register(gc.freeze)
    sys.exit(run_cli(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
