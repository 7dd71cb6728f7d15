"""What every command that runs work shares: the start, the exit-code boundary, errors on one line.

    ws = Workspace.from_env()
    start_work(ws)                 # creates the workspace, says which Prefect is in use
    with the_work():               # a UserError passes through (exit 2); any other exception is WorkFailed (exit 1)
        result = data_flow(cfg)

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


class WorkFailed(Exception):
    """The work itself failed (exit 1), as opposed to a usage or configuration error (exit 2)."""


@contextlib.contextmanager
def the_work() -> Iterator[None]:
    """Around a flow call: a UserError stays one (exit 2, wherever it was raised: before launch, in a
    task, in the launcher); any other exception is the work failing (exit 1)."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        raise WorkFailed(one_line(e)) from e


def start_work(ws: Workspace) -> None:
    """Create the workspace and say which Prefect (the flow call creates the embedded Prefect home: workspace_flow)."""
    from lmforge.flows import prefect_env

    ws.ensure()
    quiet.quiet_prefect_console()
    err_console.print(f"[dim]{prefect_env.activate().describe()}[/dim]", highlight=False)


def one_line(e: BaseException) -> str:
    """An exception as one line: its message's lines joined with " | " (a UserError is one line already)."""
    text = " | ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())
    return text if isinstance(e, (UserError, WorkFailed)) else f"{type(e).__name__}: {text}" if text else type(e).__name__
