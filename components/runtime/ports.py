"""A free TCP port on a loopback (or given) address, for servers and rank rendezvous.

    port = free_port()            # 127.0.0.1
    port_in_use("127.0.0.1", 9000)   # True when a server could not bind it now
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """True when `port` on `host` cannot be bound (as uvicorn and tritonserver bind it: SO_REUSEADDR, so a closed
    port's TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False
