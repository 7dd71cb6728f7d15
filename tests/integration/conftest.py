"""Integration fixtures: a real Prefect server on loopback, started by the code behind `lmforge prefect up`.

    def test_x(prefect_server):
        with prefect_server.settings():            # this process's Prefect client talks to it
            run_deployment(...)
        subprocess.run([...], env=prefect_server.env())   # or a child process does

`prefect_server` runs `prefect server start --host 127.0.0.1 --port <free>` in a workspace
of its own (its own SQLite database), waits for /api/health within a bound, and always
stops the server's whole process group, and any worker, at the end of the session.

`ws` is a workspace holding the small training dataset (train_support.make_dataset), built
once per test file (module scope: --dist loadfile keeps a file on one xdist worker).
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
from tests.integration.train_support import make_ws

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


@pytest.fixture(scope="module")
def ws(request, tmp_path_factory) -> Workspace:
    """A workspace with train_support.make_dataset's default dataset (testdata0001, set as LATEST), one per test file.

    A file that needs other dataset options defines its own:
        @pytest.fixture(scope="module")
        def ws(tmp_path_factory):
            return make_ws(tmp_path_factory, "name", version="other0001", vocab_size=1024)
    """
    return make_ws(tmp_path_factory, request.module.__name__.rpartition(".")[2].removeprefix("test_"))
