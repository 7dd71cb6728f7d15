"""SIGTERM or SIGINT at any point of a run's start-up leaves no process of lmforge's behind.

`lmforge run data` starts, within seconds, Prefect's temporary API server and then a local Dask
cluster (a scheduler thread, nanny and worker processes). The run is signalled at several points:
while Python imports, while the temporary server starts, while the Dask workers work. `lmforge run
train` is signalled once its DeepSpeed ranks run. Afterwards no process on the machine carries the
run's LMFORGE_HOME in its environment (every child inherits it, so an orphan reparented to init is
found too).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY_CONFIG

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def processes_with(marker: bytes) -> list[tuple[int, str]]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append((int(proc.name), (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]))
        except OSError:   # gone meanwhile, or not ours to read
            pass
    return found


def start(home: Path, log: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "LMFORGE_HOME": str(home)}
    for var in ("PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH", "PREFECT_API_URL"):
        env.pop(var, None)   # the run's own embedded Prefect, so that it starts a temporary server
    with open(log, "w") as stderr:   # a file, not a pipe: an orphan holding a pipe would block reading it
        return subprocess.Popen([sys.executable, "-m", "lmforge.cli", *args, "-c", str(TINY_CONFIG)], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr)


def assert_none_left(marker: bytes, what: str) -> None:
    deadline = time.monotonic() + 30     # a terminated child may take a moment to go (the launcher grants 20 s)
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid, _ in left:                  # never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"left behind after {what}: {left}"


# The last SIGTERM is at 10 s, not 14: CI at 6851193 signalled at 14 s a run that had just finished (exit 0); runs
# there take 14-19 s, ~11.5 s on an idle 2-core machine. Points found from the run's processes instead (Dask workers
# by their spawn_main command line) passed alone but missed the workers in a CI run (153236e): not used.
@pytest.mark.parametrize("sig, after_s", [(signal.SIGTERM, 1.5), (signal.SIGTERM, 4), (signal.SIGTERM, 7),
                                          (signal.SIGTERM, 10), (signal.SIGINT, 7)])
def test_a_signalled_run_leaves_no_process_behind(tmp_path, sig, after_s):
    home = tmp_path / "ws"
    marker = f"LMFORGE_HOME={home}".encode()
    log = tmp_path / "stderr.log"
    run = start(home, log, "run", "data")
    try:
        time.sleep(after_s)
        assert run.poll() is None, f"the run ended before it was signalled: {log.read_text()[-2000:]}"
        seen = processes_with(marker)
        run.send_signal(sig)
        run.wait(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    err = log.read_text()
    assert run.returncode == 128 + sig, err[-2000:]
    assert f"interrupted by {signal.Signals(sig).name}" in err
    assert_none_left(marker, f"{signal.Signals(sig).name} at {after_s} s (running then: {len(seen)})")


def test_a_training_run_signalled_while_its_ranks_run_leaves_no_rank_behind(tmp_path):
    home = tmp_path / "ws"
    marker = f"LMFORGE_HOME={home}".encode()
    data = start(home, tmp_path / "data.log", "run", "data")
    assert data.wait(timeout=600) == 0, (tmp_path / "data.log").read_text()[-2000:]
    log = tmp_path / "train.log"
    run = start(home, log, "run", "train", "--set", "training.max_steps=100000")
    try:
        deadline = time.monotonic() + 300
        while not (ranks := [p for p in processes_with(marker) if "lmforge.components.training.rank" in p[1]]):
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.5)
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 128 + signal.SIGTERM, log.read_text()[-2000:]
    assert_none_left(marker, f"SIGTERM while {len(ranks)} rank(s) ran")
