"""The step time and tokens/s a rank logs: averaged over the steps since the last log or checkpoint save."""

from __future__ import annotations

from lmforge.components.training.perf import ThroughputWindow


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_logged_window_averages_its_own_steps_and_tokens():
    clock = Clock()
    window = ThroughputWindow(clock)
    for _ in range(4):
        clock.now += 0.5
        window.add(1000)
    assert window.read() == (0.5, 2000.0)
    clock.now += 2.0
    window.add(1000)
    assert window.read() == (2.0, 500.0)          # the next window starts where the last was read


def test_a_save_between_logs_starts_the_window_again_steps_included():
    """Steps 1-3 unlogged, a 30 s save, then step 4 logged: 1 step of 1 s, not 1 s spread over 4 steps."""
    clock = Clock()
    window = ThroughputWindow(clock)
    for _ in range(3):
        clock.now += 1.0
        window.add(1000)
    clock.now += 30.0                             # the checkpoint save: not training time
    window.restart()
    clock.now += 1.0
    window.add(1000)
    assert window.read() == (1.0, 1000.0)
