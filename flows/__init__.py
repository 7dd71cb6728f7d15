"""Prefect flows around the components, the pipeline that chains them, and the CLI.

Importing this package points Prefect at the workspace (its database and persisted
task results live under <workspace>/prefect), unless the environment already says
otherwise, e.g. PREFECT_API_URL for a Prefect server.
"""

import logging
import os

from lmforge.components.errors import UserError
from lmforge.components.workspace import Workspace

_ws = Workspace.from_env()
(_ws.prefect / "storage").mkdir(parents=True, exist_ok=True)
os.environ.setdefault("PREFECT_HOME", str(_ws.prefect))
os.environ.setdefault("PREFECT_LOCAL_STORAGE_PATH", str(_ws.prefect / "storage"))
os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "true")
# The temporary local API server takes longer than Prefect's 20 s default to start on 2 cores.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_LOG_PRINTS", "true")
# Offline machines: telemetry only produces name-resolution errors and SQLite lock noise.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


class _UserErrorsWithoutTraceback(logging.Filter):
    """A UserError is reported on one line by the CLI; Prefect's traceback of it is noise, so drop it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], UserError):
            record.exc_info, record.exc_text = None, None
        return True


for _name in ("prefect.flow_runs", "prefect.task_runs"):
    logging.getLogger(_name).addFilter(_UserErrorsWithoutTraceback())


def _use_running_server() -> None:
    """Send runs to the server `lmforge prefect up` started for this workspace, if it is up."""
    if "PREFECT_API_URL" in os.environ:
        return
    from lmforge.flows.prefect_local import active_api_url

    url = active_api_url(_ws)
    if url:
        os.environ["PREFECT_API_URL"] = url


_use_running_server()
