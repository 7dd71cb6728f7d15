"""The CPUs this process may use, for thread and worker counts: its affinity, not the machine's count.

    usable_cpus()      # 4 in a container pinned to 4 of a host's 64 CPUs, where os.cpu_count() says 64
    cpu_share(2)       # 2: the threads each of 2 processes gets (DeepSpeed ranks, test workers)

A process confined by taskset or a container's cpuset that sized its threads by os.cpu_count() would run
that many threads on its few CPUs, each parallel region waiting on descheduled threads.
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux; elsewhere the machine's count is all there is
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_share(processes: int) -> int:
    """The threads each of `processes` processes sharing this process's CPUs gets: at least 1."""
    return max(1, usable_cpus() // max(1, processes))
