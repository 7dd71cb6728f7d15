"""Integration fixtures: a real Prefect server on loopback, started by the code behind `lmforge prefect up`.

    def test_x(prefect_server):
        with prefect_server.settings():            # this process's Prefect client talks to it
            run_deployment(...)
        subprocess.run([...], env=prefect_server.env())   # or a child process does

`prefect_server` runs `prefect server start --host 127.0.0.1 --port <free>` in a workspace
of its own (its own SQLite database), waits for /api/health within a bound, and always
stops the server's whole process group, and any worker, at the end of the session.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lmforge.components.workspace import Workspace
from lmforge.flows import prefect_local
from tests.conftest import free_port

STARTUP_TIMEOUT_S = 180


@dataclass(frozen=True)
class PrefectServer:
    api_url: str
    ws: Workspace
    pid: int

    @property
    def home(self) -> Path:
        return self.ws.prefect

    @property
    def log(self) -> Path:
        return self.ws.prefect / "server.log"

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a child process that should use this server."""
        return {**os.environ, "PREFECT_API_URL": self.api_url, "PREFECT_HOME": str(self.home), **extra}

    @contextlib.contextmanager
    def settings(self) -> Iterator[None]:
        """Point this process's Prefect client (flows, run_deployment, get_client) at the server."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: self.api_url}):
            try:
                yield
            finally:
                from prefect.logging.handlers import APILogHandler

                APILogHandler().flush()   # send queued run logs now, while this server is still up


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> Iterator[PrefectServer]:
    ws = Workspace(tmp_path_factory.mktemp("prefect_ws")).ensure()
    info = prefect_local.start_server(ws, port=free_port(), timeout=STARTUP_TIMEOUT_S)
    try:
        yield PrefectServer(api_url=info.api_url, ws=ws, pid=info.pid)
    finally:
        prefect_local.stop_all(ws)
