"""SIGTERM or SIGINT ends an `lmforge` command cleanly at any moment, and leaves none of its processes behind.

    signals.install()        # first thing in main(): both signals raise Interrupted in the main thread
    ...                      # the work unwinds (the launcher stops its ranks, Dask closes, atexit stops
                             # Prefect's temporary server); last of all at exit, after an interruption,
                             # reap() stops whatever of this command's session is still alive

A scheduler or a CI timeout sends SIGTERM, whose default action ends Python at once: no `finally`,
no `atexit`. So Prefect's temporary API server (a child that Prefect stops from `atexit`), the Dask
workers of the data stage and anything else this command started lived on as orphans. Both signals
now raise `Interrupted` (a KeyboardInterrupt, as Ctrl-C always did), so the same unwinding runs.

A library may install its own handler for a while: Prefect's flow engine raises its TerminationSignal
on SIGTERM during a flow run, and hands the signal back once that exception reaches it. When code in
between catches and wraps it (pydantic does, when the signal lands in a serializer; CI saw a run
end with PydanticSerializationError, exit 1), no Python handler of ours ever runs. So the signal is
also recorded below Python's handlers: CPython writes each caught signal's number to the wakeup fd
(`signal.set_wakeup_fd`), whichever handler then runs, and `received()` reads it there.

`reap` is the backstop for a child started in the instant before its owner registered its clean-up.
It stops only descendants in this command's own session. Services started on purpose to outlive the
command run in sessions of their own (components/runtime/supervisor.py): tritonserver once deploy has started
it, and the server of `lmforge prefect up`. The training launcher also has its own session; it stops
its ranks itself when the interruption unwinds through it.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys

import psutil

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """The command was sent `signum` (the CLI exits 128 + signum, as a shell reports it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: list[int] = []
_wakeup: list[int] = []   # the pipe CPython writes every caught signal's number to: read end, write end


def _interrupt(signum: int, _frame: object) -> None:
    for sig in SIGNALS:   # one interruption: the unwinding and the reaping are not themselves cut short
        signal.signal(sig, signal.SIG_IGN)
    _received.append(signum)
    raise Interrupted(signum)


def _reap_if_interrupted() -> None:
    if received() is not None:
        stopped = reap()
        if stopped:
            print(f"lmforge: stopped {len(stopped)} process(es) the interrupted command had left: pids "
                  f"{', '.join(map(str, stopped))}", file=sys.stderr, flush=True)


def install() -> None:
    """Both signals raise Interrupted, and each is recorded whatever handler runs; at exit, after one, reap()
    (registered first, so it runs last)."""
    read, write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    _wakeup[:] = [read, write]
    os.register_at_fork(after_in_child=_forget_in_child)
    for sig in SIGNALS:
        signal.signal(sig, _interrupt)
    atexit.register(_reap_if_interrupted)


def _forget_in_child() -> None:
    """A forked child (a fork pool's worker) keeps its own record: a SIGTERM sent to it is not this command's."""
    signal.set_wakeup_fd(-1)
    for fd in _wakeup:
        os.close(fd)
    _wakeup.clear()
    _received.clear()


def received() -> int | None:
    """The signal that interrupted this command, if one did: the first our handler saw, else the first SIGTERM or
    SIGINT another handler caught (the wakeup fd's record)."""
    while _wakeup:
        try:
            caught = os.read(_wakeup[0], 512)
        except BlockingIOError:   # nothing more recorded (the write end stays open, so never end of file)
            break
        _received.extend(n for n in caught if n in SIGNALS and n not in _received)
    return _received[0] if _received else None


def reap(*, grace: float = 10.0) -> list[int]:
    """Terminate this process's descendants in its own session, kill those still alive after `grace` s; their pids."""
    session = os.getsid(0)
    ours = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if os.getsid(proc.pid) == session:
                ours.append(proc)
        except ProcessLookupError:
            pass
    for proc in ours:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(ours, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
    return [p.pid for p in ours]
