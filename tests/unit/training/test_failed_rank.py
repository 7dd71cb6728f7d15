"""Which rank failed: a rank stopped by the launcher's SIGTERM says so, so the one that died silently is named."""

import signal
import subprocess
import sys
import time

from lmforge.components.training.launcher import _failed_rank, _Tail
from lmforge.components.training.protocol import STOPPED_PREFIX

RANK = """
import time
from lmforge.components.training.protocol import run_rank
def main():
    print("training", flush=True)
    time.sleep(60)
    return 0
run_rank(main)
"""


def test_a_rank_sent_sigterm_says_it_was_stopped_and_exits_143():
    rank = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline() == "training\n"
        time.sleep(0.2)
        rank.send_signal(signal.SIGTERM)
        out, _ = rank.communicate(timeout=20)
    finally:
        rank.kill()
    assert out.startswith(STOPPED_PREFIX) and "SIGTERM" in out
    assert rank.returncode == 128 + signal.SIGTERM


def _tails(tmp_path, logs: dict[int, str]) -> list[_Tail]:
    tails = []
    for rank, text in logs.items():
        path = tmp_path / f"0_rank{rank}.log"
        path.write_text(text)
        tail = _Tail(path, rank, lambda _r, _line: None)
        tail.flush()
        tails.append(tail)
    return tails


def test_the_silent_rank_is_named_when_its_peer_was_stopped_before_it_saw_the_loss(tmp_path):
    # CI at 589719f: rank 1 was SIGKILLed and DeepSpeed's launcher terminated rank 0 before rank 0 printed a
    # traceback, so both logs were silent and the failure named no rank.
    stopped = f"step 5\n{STOPPED_PREFIX}this rank received SIGTERM: a peer failed or the run was stopped\n"
    rank, last = _failed_rank(_tails(tmp_path, {0: stopped, 1: "step 5\n"}))
    assert rank == 1 and last == ["step 5"]


def test_no_rank_is_blamed_when_every_rank_was_stopped(tmp_path):
    stopped = f"{STOPPED_PREFIX}this rank received SIGTERM\n"
    assert _failed_rank(_tails(tmp_path, {0: stopped, 1: stopped}))[0] is None


def test_a_rank_with_its_own_traceback_is_named_before_a_silent_one(tmp_path):
    own = "Traceback (most recent call last):\n  File x\nValueError: bad shape\n"
    lost = "Traceback (most recent call last):\nRuntimeError: Connection closed by peer\n"
    assert _failed_rank(_tails(tmp_path, {0: lost, 1: own, 2: "step 3\n"}))[0] == 1
