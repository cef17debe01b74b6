"""Free TCP ports on 127.0.0.1 for the processes a benchmark (or a test) starts."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now.

    All ``n`` sockets are bound before any is closed: ports asked for one at a time can come
    back equal (the kernel may hand a just-closed ephemeral port out again), which made smg
    refuse the same port for its HTTP and Prometheus listeners.
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One TCP port free on 127.0.0.1 right now."""
    return free_ports(1)[0]
