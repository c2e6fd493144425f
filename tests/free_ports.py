"""Free TCP ports for the servers a test starts (Ray heads and nodes, HTTP apps).

Ports are picked by binding to port 0, and every socket stays open until all ``n`` are picked: a
port released at once can be handed out again by the next call, and a ``ray start`` given the same
port for two of its services fails (seen: the dashboard and its agent both on one port).
"""

from __future__ import annotations

import contextlib
import socket


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free on 127.0.0.1 a moment ago."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def free_port() -> int:
    return free_ports(1)[0]
