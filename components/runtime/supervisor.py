"""Start, recognise and stop lmforge's own long-running processes, by pid plus start time.

    rec = start([prefect, "server", "start"], log=ws.prefect / "server.log", env=env)   # own session, detached
    save(rec, ws.prefect / "server.json", api_url=url)   # the record, plus any fields of the caller's
    rec = load(ws.prefect / "server.json")               # None when there is no record
    alive(rec)                                           # True only for that very process
    stop(rec, grace=10)                                  # SIGTERM, wait, SIGKILL; True if it was running
    wait(rec, timeout=60)                                # exit code of a child started here

A ProcessRecord names a process by its pid and its start time (psutil's create_time).
When the pid has been reused by another process, the start times differ: the record is
treated as gone and that process is never signalled. Nothing here matches processes by
name or command line. Used for the Prefect server, its worker, tritonserver and the
DeepSpeed launcher of a training run.

Stopping sends SIGTERM to the process group (or, with `group=False`, to the leader only,
for a server that drains requests and stops its own children), waits `grace` seconds,
then SIGKILLs whatever is left of the group and of the descendants it had, each checked
the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Self

import psutil

from lmforge.components.workspace import atomic_write_json

# create_time is derived from boot time + clock ticks: stable for one process, to the tick.
START_TIME_TOLERANCE_S = 0.05

_popen: dict[int, subprocess.Popen] = {}  # children this process started, so that stopping one reaps it


@dataclass(frozen=True)
class ProcessRecord:
    pid: int
    create_time: float
    pgid: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ProcessRecord":
        """A record from a state file; one without a start time (written by an older lmforge) never matches."""
        pid = int(data["pid"])
        return cls(pid=pid, create_time=float(data.get("create_time") or 0.0), pgid=int(data.get("pgid") or pid))


class HoldsProcess:
    """Mixed into the dataclass a started service is known by (deploy/server.py's and deploy/gateway.py's info, the
    Prefect server's): its `process` field is the ProcessRecord, and `pid` reads from it."""
    process: ProcessRecord

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    def from_saved(cls, data: Mapping[str, Any]) -> Self:
        """The info from its saved form (dataclasses.asdict): `process` as saved, or the flat pid and create_time an
        older lmforge wrote beside the other fields; a saved key the class has no field for is left out."""
        names = {f.name for f in fields(cls)} - {"process"}   # type: ignore[arg-type]  # mixed into dataclasses only
        return cls(process=ProcessRecord.from_dict(data.get("process") or data),  # type: ignore[call-arg]
                   **{k: v for k, v in data.items() if k in names})


def record(pid: int) -> ProcessRecord:
    """The record of a running process (raises psutil.NoSuchProcess if there is none)."""
    proc = psutil.Process(pid)
    return ProcessRecord(pid=pid, create_time=proc.create_time(), pgid=os.getpgid(pid))


def start(cmd: Sequence[str], *, log: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None,
          append: bool = True, own_session: bool = True) -> ProcessRecord:
    """Launch `cmd` in a session of its own (Ctrl-C in the caller's terminal does not reach it), output to `log`.

    `own_session=False`: a process group of its own in the caller's session instead, for a process that must not
    outlive its caller: Ctrl-C in the terminal still does not reach it, and the CLI's reaper (cli/signals.py),
    which stops what is left in its session after an interruption, does.
    """
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    where = {"start_new_session": True} if own_session else {"process_group": 0}
    with open(log, "ab" if append else "wb") as out:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(env) if env is not None else None, cwd=cwd, **where)
    _popen[proc.pid] = proc
    try:
        return record(proc.pid)
    except psutil.NoSuchProcess:  # it died at once: a record that matches nothing
        _reap(proc.pid)
        return ProcessRecord(pid=proc.pid, create_time=0.0, pgid=proc.pid)


def process(rec: ProcessRecord) -> psutil.Process | None:
    """The live process `rec` names, or None (gone, a zombie, or the pid now belongs to another process)."""
    popen = _popen.get(rec.pid)
    if popen is not None and popen.poll() is not None:  # ours and exited: poll() has reaped it
        _popen.pop(rec.pid, None)
        return None
    try:
        proc = psutil.Process(rec.pid)
        if abs(proc.create_time() - rec.create_time) > START_TIME_TOLERANCE_S:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return proc


def alive(rec: ProcessRecord) -> bool:
    return process(rec) is not None


def stop(rec: ProcessRecord, *, grace: float = 10.0, group: bool = True) -> bool:
    """SIGTERM (the group, or the leader only), wait up to `grace` s, then SIGKILL what is left. True if it ran."""
    proc = process(rec)
    if proc is None:
        _reap(rec.pid)
        return False
    family = [proc]
    with contextlib.suppress(psutil.Error):
        family += proc.children(recursive=True)
    if group and rec.pgid == rec.pid:  # the group is ours only when the record's process leads it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rec.pgid, signal.SIGTERM)
    else:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, left = psutil.wait_procs([proc], timeout=grace)
    if left and rec.pgid == rec.pid and alive(rec):  # the leader still runs, so the group id is still its own
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rec.pgid, signal.SIGKILL)
    for member in family:  # psutil refuses to signal a pid that now names another process
        with contextlib.suppress(psutil.Error):
            member.kill()
    psutil.wait_procs(family, timeout=5)
    _reap(rec.pid)
    return True


def wait(rec: ProcessRecord, timeout: float | None = None) -> int:
    """The exit code of a process this process started; raises subprocess.TimeoutExpired after `timeout` s."""
    popen = _popen.get(rec.pid)
    assert popen is not None, f"pid {rec.pid} was not started by this process's supervisor"
    rc = popen.wait(timeout=timeout)
    _popen.pop(rec.pid, None)
    return rc


def save(rec: ProcessRecord, path: Path, **extra: Any) -> dict[str, Any]:
    """Write the record (and the caller's fields) atomically as JSON; returns what was written."""
    data = {**extra, **rec.to_dict()}
    atomic_write_json(Path(path), data)
    return data


def load(path: Path) -> ProcessRecord | None:
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return ProcessRecord.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError):  # a damaged or foreign file names no process of ours
        return None


def _reap(pid: int) -> None:
    popen = _popen.pop(pid, None)
    if popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=5)
