"""One lifecycle for lmforge's local services (tritonserver, the Prefect server and worker).

    svc = Service("prefect server", [prefect, "server", "start", ...], log=ws.prefect / "server.log", env=env,
                  ready=http_ok("http://127.0.0.1:4200/api/health"), address="http://127.0.0.1:4200/api")
    rec = start(svc, timeout=120)             # launch, wait until ready (bounded); on failure stop it, UserError
    rec = launch(svc)                         # or launch only ...
    wait_ready(svc, rec, timeout=60)          # ... and wait later: ServiceNotReady names the log's last lines
    save_state(ws.prefect / "server.json", rec, api_url=url)   # atomic JSON: the record plus the caller's fields
    rec, fields = running(ws.prefect / "server.json")         # (None, {}) unless that very process still runs
    stop(rec, grace=10)                       # SIGTERM, wait, SIGKILL (components/runtime/supervisor.py)
    stop_recorded(ws.prefect / "server.json") # stop what a state file names, then remove the file

A service differs from another only in its command line, its environment and how it
says it is ready (`ready`, usually an HTTP health URL); the rest lives here. Processes
are started, recognised (pid plus start time, never by name) and stopped by
components/runtime/supervisor.py, so a recorded pid that now belongs to another process is
never signalled.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.runtime import supervisor

POLL_S = 0.25  # between readiness probes: quick enough for a test, cheap for the service


class ServiceNotReady(UserError):
    """A service exited while starting, or was not ready within its bound; the message ends with its log's tail."""


@dataclass(frozen=True)
class Service:
    name: str                                   # in messages: "tritonserver", "prefect server"
    cmd: Sequence[str]
    log: Path
    ready: Callable[[], bool] | None = None     # None: a service with no readiness signal (a worker)
    env: Mapping[str, str] | None = None
    cwd: Path | None = None
    address: str = ""                           # where it answers, for messages
    group: bool = True                          # False: stop SIGTERMs the leader only (it stops its children)
    timeout_fix: str = ""                       # what to do when it is slow to become ready
    own_session: bool = True                    # False: it lives and dies with its caller (supervisor.start)


def http_ok(url: str, *, timeout: float = 2.0) -> Callable[[], bool]:
    """A readiness probe: True when GET `url` answers 200."""
    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):  # refused, reset, timed out: not ready yet
            return False
    return probe


def launch(svc: Service) -> supervisor.ProcessRecord:
    """Start the service in a session of its own (or, with `own_session=False`, a process group of its own in the
    caller's session; Ctrl-C in the caller's terminal reaches neither); do not wait."""
    return supervisor.start(svc.cmd, log=svc.log, env=svc.env, cwd=svc.cwd, own_session=svc.own_session)


def wait_ready(svc: Service, rec: supervisor.ProcessRecord, *, timeout: float) -> None:
    """Block until `svc.ready()`; raise ServiceNotReady (with the log's tail) if it exits or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not supervisor.alive(rec):
            raise ServiceNotReady(svc.name, rec.pid, f"exited while starting: {log_tail(svc.log)}",
                                  f"See {svc.log}")
        if svc.ready is None or svc.ready():
            return
        time.sleep(POLL_S)
    fix = f"See {svc.log}" + (f", or {svc.timeout_fix}" if svc.timeout_fix else "")
    raise ServiceNotReady(svc.name, svc.address or rec.pid,
                          f"was not ready within {timeout:.0f} s: {log_tail(svc.log)}", fix)


def start(svc: Service, *, timeout: float) -> supervisor.ProcessRecord:
    """Launch and wait until ready; a service that never gets ready is stopped again before the error propagates."""
    rec = launch(svc)
    try:
        wait_ready(svc, rec, timeout=timeout)
    except BaseException:  # Ctrl-C included: nothing half-started is left behind
        stop(rec, group=svc.group)
        raise
    return rec


def alive(rec: supervisor.ProcessRecord) -> bool:
    """True while the very process `rec` names runs (a recycled pid or a zombie is not it)."""
    return supervisor.alive(rec)


def stop(rec: supervisor.ProcessRecord, *, grace: float = 10.0, group: bool = True) -> bool:
    """SIGTERM, up to `grace` s, then SIGKILL of what is left; True if it was running."""
    return supervisor.stop(rec, grace=grace, group=group)


# --- the state file ------------------------------------------------------------

def save_state(path: Path, rec: supervisor.ProcessRecord, **fields: Any) -> dict[str, Any]:
    """Write the record and the caller's fields as JSON, atomically (a reader sees the old file or the new one)."""
    return supervisor.save(rec, Path(path), **fields)


def load_state(path: Path) -> tuple[supervisor.ProcessRecord | None, dict[str, Any]]:
    """(record, every field) of a state file; (None, {}) when there is none or it is damaged."""
    try:
        data = json.loads(Path(path).read_text())
        return supervisor.ProcessRecord.from_dict(data), data
    except (OSError, ValueError, KeyError, TypeError):  # none, damaged, or a file that names no process of ours
        return None, {}


def running(path: Path) -> tuple[supervisor.ProcessRecord | None, dict[str, Any]]:
    """The state file's record and fields if that very process still runs, else (None, {})."""
    rec, data = load_state(path)
    if rec is None or not alive(rec):
        return None, {}
    return rec, data


def stop_recorded(path: Path, *, grace: float = 10.0, group: bool = True) -> bool:
    """Stop the process a state file records (only if it is that very process), then remove the file."""
    rec = supervisor.load(Path(path))
    if rec is None:
        return False
    stopped = stop(rec, grace=grace, group=group)
    Path(path).unlink(missing_ok=True)
    return stopped


def log_tail(path: str | Path | None, *, lines: int = 6) -> str:
    """The log's last lines on one line (" | "-joined), for an error message."""
    if path is None:
        return "(no log)"
    try:
        text = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(line.strip() for line in text[-lines:]) or "(empty log)"
