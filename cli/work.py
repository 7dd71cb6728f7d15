"""What every command that runs work shares: the start, the exit-code boundary, errors on one line.

    ws = Workspace.from_env()
    start_work(ws)                 # creates the workspace, says which Prefect is in use, starts its temporary server
    from lmforge.flows.data import data_flow   # imported meanwhile: the server gets ready on the other core
    with the_work():               # waits for that server; a UserError passes through (exit 2); any other exception
        result = data_flow(cfg)    # is WorkFailed (exit 1)

Both cli.py and the command groups in commands/ import it, so neither imports the other for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console

from lmforge.components.errors import UserError
from lmforge.components.workspace import Workspace
from lmforge.flows import quiet

err_console = Console(stderr=True)
_started: list = []   # (workspace, the temporary Prefect server start_work started (flows/prefect_local.py)), if it did


class WorkFailed(Exception):
    """The work itself failed (exit 1), as opposed to a usage or configuration error (exit 2)."""


@contextlib.contextmanager
def the_work() -> Iterator[None]:
    """Around a flow call: a UserError stays one (exit 2, wherever it was raised: before launch, in a
    task, in the launcher); any other exception is the work failing (exit 1)."""
    try:
        for ws, server in _started:
            if not server.ready:
                open_tracking_store(ws)   # while the server gets ready
            server.wait()
        yield
    except UserError:
        raise
    except Exception as e:
        raise WorkFailed(one_line(e)) from e


def start_work(ws: Workspace) -> None:
    """Create the workspace, say which Prefect, and in the embedded mode start its temporary server now (call this
    before importing the flows: the server starts while they import; `the_work` waits for it)."""
    from lmforge.flows import prefect_env, prefect_local

    ws.ensure()
    mode = prefect_env.activate()
    server = prefect_local.start_temporary(ws, mode)   # before anything imports prefect
    if server is not None:
        _started.append((ws, server))
    quiet.quiet_prefect_console()
    err_console.print(f"[dim]{mode.describe()}[/dim]", highlight=False)


def open_tracking_store(ws: Workspace) -> None:
    """Open the workspace's MLflow store now, which every stage logs to: its import, and on a new workspace the
    creation of its tables, take seconds that the wait for Prefect's temporary server leaves idle. Only the
    workspace's own SQLite store (a user's MLflow server or store is left to the stage), and nothing fails here:
    an error is met, and reported, where the stage uses the store, as before."""
    from lmforge.components import tracking

    if tracking.tracking_uri(ws) != ws.mlflow_uri:
        return
    try:
        tracking.use_workspace(ws).search_experiments(max_results=1)
    except Exception:  # noqa: BLE001 (reported by the stage that logs, as it always was)
        pass


def one_line(e: BaseException) -> str:
    """An exception as one line: its message's lines joined with " | " (a UserError is one line already)."""
    text = " | ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())
    return text if isinstance(e, (UserError, WorkFailed)) else f"{type(e).__name__}: {text}" if text else type(e).__name__
