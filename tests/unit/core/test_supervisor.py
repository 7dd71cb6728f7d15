"""The process supervisor knows its processes by pid + start time, and never signals a pid that was reused."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from lmforge.components.runtime import supervisor
from lmforge.components.runtime.supervisor import ProcessRecord

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
# A parent that ignores SIGTERM and has a child: only SIGKILL of the group ends both.
STUBBORN = [sys.executable, "-c",
            "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "time.sleep(120)']); time.sleep(120)"]


def test_start_records_pid_start_time_and_its_own_group(tmp_path):
    rec = supervisor.start(SLEEPER, log=tmp_path / "s.log")
    try:
        assert rec.pgid == rec.pid  # a session of its own
        assert rec.create_time == pytest.approx(psutil.Process(rec.pid).create_time())
        assert supervisor.alive(rec)
    finally:
        assert supervisor.stop(rec, grace=5)
    assert not supervisor.alive(rec)
    assert not supervisor.stop(rec)  # stopping twice: it was not running


def test_a_reused_pid_is_treated_as_gone_and_never_signalled(tmp_path):
    """A record whose start time is not the running process's: alive() is False and stop() sends nothing."""
    other = subprocess.Popen(SLEEPER)   # stands for the unrelated process that now has the recorded pid
    try:
        real = supervisor.record(other.pid)
        stale = ProcessRecord(pid=other.pid, create_time=real.create_time - 3600, pgid=other.pid)
        assert not supervisor.alive(stale)
        assert supervisor.stop(stale, grace=1) is False
        time.sleep(0.3)
        assert other.poll() is None, "the unrelated process was signalled"
    finally:
        other.kill()
        other.wait()


def test_record_files_round_trip_and_old_ones_never_match(tmp_path):
    rec = supervisor.record(os.getpid())
    data = supervisor.save(rec, tmp_path / "server.json", api_url="http://127.0.0.1:1/api")
    assert data["api_url"] == "http://127.0.0.1:1/api"
    assert supervisor.load(tmp_path / "server.json") == rec
    assert supervisor.alive(rec)
    # A state file from before start times were recorded: this very pid, but no start time -> not ours.
    (tmp_path / "old.json").write_text(f'{{"pid": {os.getpid()}}}')
    assert not supervisor.alive(supervisor.load(tmp_path / "old.json"))
    (tmp_path / "bad.json").write_text("not json")
    assert supervisor.load(tmp_path / "bad.json") is None
    assert supervisor.load(tmp_path / "missing.json") is None


def test_stop_escalates_to_sigkill_of_the_group_and_its_children(tmp_path):
    rec = supervisor.start(STUBBORN, log=tmp_path / "s.log")
    deadline = time.monotonic() + 30
    while not psutil.Process(rec.pid).children() and time.monotonic() < deadline:
        time.sleep(0.1)
    child = psutil.Process(rec.pid).children()[0]
    started = time.monotonic()
    assert supervisor.stop(rec, grace=1)
    assert time.monotonic() - started < 10
    assert not supervisor.alive(rec)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_leader_only_termination_leaves_the_group_signal_to_the_server(tmp_path):
    """group=False: SIGTERM goes to the leader alone (Triton drains, then stops its own stubs)."""
    rec = supervisor.start([sys.executable, "-c", "import time; time.sleep(120)"], log=tmp_path / "s.log")
    assert supervisor.stop(rec, grace=5, group=False)
    assert not supervisor.alive(rec)


def test_a_process_that_exited_is_not_alive_even_before_it_is_reaped(tmp_path):
    rec = supervisor.start([sys.executable, "-c", "pass"], log=tmp_path / "s.log")
    deadline = time.monotonic() + 20
    while supervisor.alive(rec) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not supervisor.alive(rec)
    with pytest.raises(ProcessLookupError):
        os.kill(rec.pid, 0)  # reaped: no zombie left behind


def test_an_info_holding_a_process_record_saves_it_whole_and_reads_the_older_flat_form():
    from dataclasses import asdict, dataclass

    @dataclass(frozen=True)
    class Info(supervisor.HoldsProcess):
        host: str
        process: ProcessRecord

    info = Info(host="h", process=ProcessRecord(pid=41, create_time=12.5, pgid=40))
    saved = asdict(info)
    assert saved == {"host": "h", "process": {"pid": 41, "create_time": 12.5, "pgid": 40}} and info.pid == 41
    assert Info.from_saved({**saved, "base_url": "not a field"}) == info
    # Written before the record (pid and create_time beside the other fields): the group is the pid's own.
    old = Info.from_saved({"host": "h", "pid": 41, "create_time": 12.5})
    assert old.process == ProcessRecord(pid=41, create_time=12.5, pgid=41) and old.pid == 41
