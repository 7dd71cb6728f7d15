"""A rank stops when the process that launched training is killed outright, instead of training on as an orphan."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

RANK = """
import time
from lmforge.components.training.protocol import watch_supervisor
watch_supervisor(interval_s=0.2)
time.sleep(60)
"""


def test_rank_exits_after_its_launcher_is_sigkilled():
    # The "launcher" starts a stand-in rank that watches it, prints the rank's pid, then idles.
    launcher_code = f"""
import os, socket, subprocess, sys, time
env = dict(os.environ, LMFORGE_SUPERVISOR=f"{{socket.gethostname()}}:{{os.getpid()}}", PYTHONPATH={str(REPO)!r})
rank = subprocess.Popen([sys.executable, "-c", {RANK!r}], env=env, start_new_session=True)
print(rank.pid, flush=True)
time.sleep(60)
"""
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], stdout=subprocess.PIPE, text=True)
    rank_pid = int(launcher.stdout.readline())
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(rank_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(rank_pid, signal.SIGKILL)
    raise AssertionError("the rank kept running after its launcher was killed")


def test_a_rank_on_another_host_does_not_watch(monkeypatch):
    from lmforge.components.training import protocol

    monkeypatch.setenv(protocol.SUPERVISOR_ENV, f"not-{socket.gethostname()}:1")
    protocol.watch_supervisor()
    assert not any(t.name == "supervisor-watch" for t in threading.enumerate())
