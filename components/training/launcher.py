"""Run the `deepspeed` launcher as a subprocess: N local ranks, rank-prefixed output, failures named.

    result = launch(LaunchRequest(run_dir=..., request=RankRequest(...), num_ranks=2),
                    on_line=lambda rank, line: print(f"[rank{rank}] {line}"),
                    on_event=lambda ev: print(ev["step"], ev["loss"]))
    result.events          # the step events rank 0 emitted, in order

The backend is DeepSpeed's accelerator's (gloo on CPU, NCCL on CUDA), so the same command
runs on both; on CUDA the ranks go to the GPUs named in `gpus` (`--include localhost:<ids>`).
Threads per rank = cores / local ranks, so that ranks x threads = cores. A hostfile is passed
through for multi-node. Each rank writes its own log (`--enable_each_rank_log`); they are
tailed and streamed with a rank prefix. When a rank fails, LaunchFailed carries that rank's
last lines; a UserError raised inside a rank (say, a truncated checkpoint) comes back as the
same UserError. What the ranks read and print back is fixed in components/training/protocol.py,
which both sides import.
"""

from __future__ import annotations

import collections
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.runtime import supervisor
from lmforge.components.runtime.cpus import cpu_share
from lmforge.components.runtime.ports import free_port
from lmforge.components.training.ops import extensions_env, load_ops
from lmforge.components.training.protocol import (
    EVENT_PREFIX,
    STOPPED_PREFIX,
    SUPERVISOR_ENV,
    USER_ERROR_PREFIX,
    RankRequest,
    request_file,
    write_request,
)

PORT_TRIES = 3  # launches on a fresh port when the one picked was taken first (see launch)
_RANK_LOG = re.compile(r"_rank(\d+)\.log$")
_PEER_LOST = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|ProcessGroupGloo|NCCL|DistBackendError|"
                        r"wait timeout|Timed out|SIGTERM|KeyboardInterrupt", re.IGNORECASE)


class LaunchFailed(RuntimeError):
    """A rank died: the message names it and quotes its last lines."""

    def __init__(self, message: str, rank: int | None, last_lines: list[str], returncode: int, *,
                 port_taken: bool = False) -> None:
        super().__init__(message)
        self.rank, self.last_lines, self.returncode = rank, last_lines, returncode
        self.port_taken = port_taken  # a rank could not bind the rendezvous port (EADDRINUSE)


@dataclass(frozen=True)
class LaunchRequest:
    run_dir: Path
    request: RankRequest             # what components.training.rank reads (components/training/protocol.py)
    num_ranks: int = 2
    hostfile: str | None = None
    gpus: tuple[str, ...] = ()       # physical GPU ids to run on (one rank each); empty = CPU ranks
    master_port: int | None = None
    timeout_s: float | None = None


@dataclass
class LaunchResult:
    returncode: int
    seconds: float
    events: list[dict[str, Any]] = field(default_factory=list)
    log_dir: Path | None = None
    backend: str = ""


def command(req: LaunchRequest, request_path: Path, log_dir: Path, port: int, *,
            module: str = "lmforge.components.training.rank") -> list[str]:
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--master_port", str(port),
           "--module", "--no_local_rank", "--enable_each_rank_log", str(log_dir)]
    if req.hostfile:
        cmd += ["--hostfile", req.hostfile]
    elif req.gpus:
        # --include names the GPUs the scheduler gave (CUDA_VISIBLE_DEVICES); --num_gpus would make
        # DeepSpeed drop that variable and take GPUs 0..N-1 of the whole machine.
        assert len(req.gpus) >= req.num_ranks, (req.gpus, req.num_ranks)
        cmd += ["--include", "localhost:" + ",".join(req.gpus[:req.num_ranks])]
    else:
        cmd += ["--num_gpus", str(req.num_ranks)]  # CPU ranks: DeepSpeed's CPU accelerator takes any count
    return cmd + [module, "--request", str(request_path)]


def rank_module(request: RankRequest) -> str:
    """The rank entry: DeepSpeed's engine, or the parameter-server family's, which runs beside it (training/ps/)."""
    ps = request.training.parallel.parameter_server
    return "lmforge.components.training.ps.rank" if ps else "lmforge.components.training.rank"


def backend_name() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


class _Tail:
    """Follows one rank's log file, handing complete lines to a callback."""

    def __init__(self, path: Path, rank: int, sink: Callable[[int, str], None]) -> None:
        self.path, self.rank, self.sink = path, rank, sink
        self.pos, self.buf = 0, ""
        self.last: collections.deque[str] = collections.deque(maxlen=25)
        self.traceback = self.peer_lost = False  # over the whole log: a long traceback outgrows `last`
        self.stopped = False                     # the rank said it was stopped by SIGTERM (protocol.py, STOPPED_PREFIX)
        self.port_taken = False                  # the rendezvous store could not bind its port

    def poll(self) -> None:
        with open(self.path, encoding="utf-8", errors="replace") as f:
            f.seek(self.pos)
            chunk = f.read()
            self.pos = f.tell()
        self.buf += chunk
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            self._note(line)
            self.sink(self.rank, line)

    def _note(self, line: str) -> None:
        self.last.append(line)
        self.traceback |= "Traceback (most recent call last)" in line or line.startswith(USER_ERROR_PREFIX)
        self.peer_lost |= self.traceback and bool(_PEER_LOST.search(line))
        self.stopped |= line.startswith(STOPPED_PREFIX)
        self.port_taken |= "EADDRINUSE" in line

    def flush(self) -> None:
        self.poll()
        if self.buf:
            self._note(self.buf)
            self.sink(self.rank, self.buf)
            self.buf = ""


def rank_env(num_ranks: int) -> dict[str, str]:
    """The ranks' environment: this process's, their share of the cores, unbuffered output, the folder the ops were
    built in (ops.extensions_env) and who supervises them (protocol.watch_supervisor)."""
    return {**os.environ, "OMP_NUM_THREADS": str(cpu_share(num_ranks)), "PYTHONUNBUFFERED": "1",
            **extensions_env(), SUPERVISOR_ENV: f"{socket.gethostname()}:{os.getpid()}"}


def launch(req: LaunchRequest, *, on_line: Callable[[int, str], None] | None = None,
           on_event: Callable[[dict[str, Any]], None] | None = None) -> LaunchResult:
    """Run the job to the end; raise LaunchFailed (or a rank's UserError) when it fails.

    free_port can only say a port was free a moment ago: another process (a server, or the kernel's pick for
    an outgoing connection) may take it before rank 0's rendezvous store binds it. When this launcher picked
    the port and a rank says it was taken (EADDRINUSE), the job is launched again on a fresh port, at most
    PORT_TRIES times in all; that try's logs are kept beside the attempt's as `attempt-<n>.port-<port>-taken`.
    A port the config fixed (`[training] master_port`) is never changed: its clash is the error.
    """
    lines_out = on_line or (lambda rank, line: print(f"[rank{rank}] {line}", flush=True))
    tries = 1
    while True:
        port = req.master_port or free_port()
        try:
            return _launch_on(req, port, lines_out, on_event)
        except LaunchFailed as failed:
            if req.master_port or tries == PORT_TRIES or not failed.port_taken:
                raise
        log_dir = _log_dir(req)
        log_dir.rename(log_dir.with_name(f"{log_dir.name}.port-{port}-taken"))
        lines_out(-1, f"rendezvous port {port} was taken before rank 0 could bind it; launching again on a "
                      f"fresh port (try {tries + 1} of {PORT_TRIES})")
        tries += 1


def _log_dir(req: LaunchRequest) -> Path:
    return Path(req.run_dir).resolve() / "logs" / f"attempt-{req.request.attempt}"


def _launch_on(req: LaunchRequest, port: int, lines_out: Callable[[int, str], None],
               on_event: Callable[[dict[str, Any]], None] | None) -> LaunchResult:
    run_dir = Path(req.run_dir).resolve()  # the ranks run with it as their working folder
    log_dir = _log_dir(req)
    log_dir.mkdir(parents=True, exist_ok=True)
    request_path = write_request(run_dir / request_file(req.request.attempt), req.request)
    env = rank_env(req.num_ranks)
    events: list[dict[str, Any]] = []
    user_errors: list[dict[str, Any]] = []

    def sink(rank: int, line: str) -> None:
        if line.startswith(EVENT_PREFIX):
            event = json.loads(line[len(EVENT_PREFIX):])
            events.append(event)
            if on_event:
                on_event(event)
            return
        if line.startswith(USER_ERROR_PREFIX):
            user_errors.append(json.loads(line[len(USER_ERROR_PREFIX):]))
        lines_out(rank, line)

    load_ops(req.request.ds_config, device=req.request.hardware.device)
    start = time.perf_counter()
    # Its own session, so that stopping it reaches every rank; the ranks watch it in turn (watch_supervisor).
    launcher = supervisor.start(command(req, request_path, log_dir, port, module=rank_module(req.request)),
                                log=log_dir / "launcher.log", env=env, cwd=run_dir, append=False)
    tails: dict[Path, _Tail] = {}
    launcher_tail = _Tail(log_dir / "launcher.log", -1, lambda _r, line: lines_out(-1, line))
    stop = threading.Event()

    def follow() -> None:
        while not stop.is_set():
            for path in log_dir.glob("*_rank*.log"):
                m = _RANK_LOG.search(path.name)
                if m and path not in tails:
                    tails[path] = _Tail(path, int(m.group(1)), sink)
            for tail in [launcher_tail, *tails.values()]:
                tail.poll()
            stop.wait(0.1)

    follower = threading.Thread(target=follow, name="rank-logs", daemon=True)
    follower.start()
    try:
        rc = supervisor.wait(launcher, timeout=req.timeout_s)
    except subprocess.TimeoutExpired:
        supervisor.stop(launcher, grace=20)
        rc = -9
    except BaseException:
        supervisor.stop(launcher, grace=20)
        raise
    finally:
        stop.set()
        follower.join()
        for tail in [launcher_tail, *tails.values()]:
            tail.flush()
        release_shm_buffers(port)
    seconds = time.perf_counter() - start
    if rc == 0:
        return LaunchResult(0, seconds, events, log_dir, backend_name())
    if user_errors:
        e = user_errors[0]
        raise UserError(e["what"], e.get("value"), e.get("problem", ""), e.get("fix", ""))
    rank, last = _failed_rank(list(tails.values()))
    silent = rank is not None and not any(t.traceback for t in tails.values() if t.rank == rank)
    where = (f"rank {rank} died without a traceback (killed by a signal or out of memory?)" if silent
             else f"rank {rank} failed" if rank is not None else "a rank failed (which one is unclear)")
    quoted = "\n".join(f"  [rank{'?' if rank is None else rank}] {line}" for line in last[-12:])
    if rank is None:  # no rank says why: the launcher's own lines name the return code of the one that exited
        quoted += "\n" + "\n".join(f"  [launcher] {line}" for line in list(launcher_tail.last)[-6:])
    raise LaunchFailed(f"training failed: {where}; launcher exit code {rc}. Its last lines:\n{quoted}\n"
                       f"(all rank logs: {log_dir})", rank, last, rc,
                       port_taken=any(t.port_taken for t in tails.values()))


def shm_buffers(port: int) -> list[Path]:
    """DeepSpeed's shared-memory allreduce buffers of the job on `port` (CPU ranks on one machine).

    Each CPU rank creates /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>
    (about 66 MiB; ops/csrc/cpu/comm/shm.cpp, shm_initialize) and DeepSpeed never unlinks it, so
    every run would hold RAM until the machine restarts.
    """
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def release_shm_buffers(port: int) -> None:
    """Unlink the job's buffers once its ranks are gone (a rank that still maps one keeps its memory)."""
    for path in shm_buffers(port):
        path.unlink(missing_ok=True)


def _failed_rank(tails: list[_Tail]) -> tuple[int | None, list[str]]:
    """The rank that failed first, from its log.

    A rank whose own code failed prints a traceback that is not about lost peers; when one
    rank dies without a word (SIGKILL, out of memory), the others fail in a collective with
    a lost-peer error or say they were stopped by the launcher's SIGTERM, so the silent one is the culprit.
    """
    tails = sorted(tails, key=lambda t: t.rank)
    own = [t for t in tails if t.traceback and not t.peer_lost]
    if own:
        return own[0].rank, list(own[0].last)
    silent = [t for t in tails if not t.traceback and not t.stopped]
    if silent and len(silent) < len(tails):
        return silent[0].rank, list(silent[0].last)
    return (None, list(tails[0].last)) if tails else (None, [])
