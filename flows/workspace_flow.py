"""`workspace_flow`: `prefect.flow` for lmforge's flows, with the embedded Prefect home in place first.

    @workspace_flow(name="data", log_prints=True)
    def data_flow(cfg): ...

    data_flow(cfg)     # from Python, in a folder with no .lmforge yet: works

Importing lmforge.flows writes nothing (flows/prefect_env.py): it only points PREFECT_HOME
at <workspace>/prefect when no Prefect of the user's is set up. The `lmforge` CLI creates
that folder before work runs; a flow called straight from Python did not, so Prefect started
its temporary server on a database in a folder that did not exist and gave up after two
minutes ("Timed out while attempting to connect to ephemeral Prefect API server"). Calling a
WorkspaceFlow creates the folder first, and only in that embedded mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import Flow

from lmforge.flows import prefect_env


class WorkspaceFlow(Flow):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        prefect_env.prepare(prefect_env.activate())
        return super().__call__(*args, **kwargs)


def workspace_flow(**options: Any) -> Callable[[Callable[..., Any]], WorkspaceFlow]:
    """Like `@prefect.flow(**options)`."""
    return lambda fn: WorkspaceFlow(fn, **options)
