"""A free TCP port on a loopback (or given) address, for servers and rank rendezvous.

    port = free_port()            # 127.0.0.1
    port_in_use("127.0.0.1", 9000)   # True when a server could not bind it now

A port found free can be taken before its server binds it. The kernel hands out the ephemeral range
(net.ipv4.ip_local_port_range, 32768-60999 by default) to every outgoing connection too, so a port asked of
bind(0) is one that the next client connection on the machine may take. free_port picks at random below that
range instead, as Google's portpicker does, where only another listener could take it; callers that choose
the port themselves still relaunch on a clash (components/training/launcher.py).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 15000   # below the ports most services are configured on
TRIES = 64       # random picks before falling back to the kernel's choice
_PICKS = random.SystemRandom()  # not the seeded module state: two test workers seeded alike would pick alike


def free_port(host: str = "127.0.0.1") -> int:
    below = range(LOWEST, ephemeral_floor())
    for port in _PICKS.sample(below, min(TRIES, len(below))):
        if _binds(host, port):
            return port
    with socket.socket() as s:  # nothing free below the range (or no range below it): the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ephemeral_floor() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's ip_local_port_range; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _binds(host: str, port: int, *, reuse: bool = False) -> bool:
    """True when `port` on `host` can be bound now; with `reuse` (SO_REUSEADDR), a closed port's TIME_WAIT does not
    count against it."""
    with socket.socket() as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def port_in_use(host: str, port: int) -> bool:
    """True when `port` on `host` cannot be bound as uvicorn and tritonserver bind it (SO_REUSEADDR)."""
    return not _binds(host, port, reuse=True)
