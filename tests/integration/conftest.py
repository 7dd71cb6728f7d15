"""Integration fixtures: a real Prefect server on loopback.

    def test_x(prefect_server):
        with prefect_server.settings():            # this process's Prefect client talks to it
            run_deployment(...)
        subprocess.run([...], env=prefect_server.env())   # or a child process does

`prefect_server` runs `prefect server start --host 127.0.0.1 --port <free>` with a
temporary PREFECT_HOME (its own SQLite database), waits for /api/health within a bound,
and always stops the server's whole process group at the end of the session.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import free_port

STARTUP_TIMEOUT_S = 180


@dataclass(frozen=True)
class PrefectServer:
    api_url: str
    home: Path
    pid: int
    log: Path

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


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> Iterator[PrefectServer]:
    home = tmp_path_factory.mktemp("prefect_home")
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    log = home / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    prefect = str(Path(sys.executable).with_name("prefect"))
    with open(log, "wb") as out:
        proc = subprocess.Popen([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(api_url):
            if proc.poll() is not None:
                pytest.fail(f"prefect server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"prefect server not healthy after {STARTUP_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield PrefectServer(api_url=api_url, home=home, pid=proc.pid, log=log)
    finally:
        _stop(proc)
