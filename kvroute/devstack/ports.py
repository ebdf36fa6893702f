"""Free loopback ports for the servers we start (Redis nodes, engines, agents' metrics).

A port found free is only free until someone listens on it, and the servers started here bind
theirs a while later (a Python process importing its libraries: seconds on a loaded machine).
Meanwhile the kernel hands local ports of the *ephemeral* range to outgoing connections (every
Redis client, every cluster bus link), so a port drawn there by binding to port 0 can be taken
before its server starts, which then fails to listen. Ports are therefore drawn below that range,
where no outgoing connection goes, and never twice by one process.
"""

from __future__ import annotations

import random
import socket
from collections import deque
from pathlib import Path

HOST = "127.0.0.1"
LOWEST = 10_000  # below: ports that well-known services may expect
_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Ports this process has handed out lately: two servers about to start must not get the same one.
_handed_out: deque[int] = deque(maxlen=4096)


def ephemeral_floor() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's default where unknown)."""
    try:
        return int(_PORT_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def bindable(port: int) -> bool:
    """Whether a server could listen on ``port`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # as servers do: a port whose old connections linger in TIME_WAIT is free to listen on
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def usable(port: int) -> bool:
    """Free to listen on and not handed out by this process already."""
    return port not in _handed_out and bindable(port)


def claim(*ports: int) -> None:
    """Mark ``ports`` handed out (found with :func:`usable`): :func:`free_port` will not give them."""
    _handed_out.extend(ports)


def free_port() -> int:
    """A port free to listen on, below the ephemeral range where there is room, else one the
    kernel picks."""
    top = ephemeral_floor()
    if top - LOWEST > 1000:
        for _ in range(500):
            port = random.randrange(LOWEST, top)
            if usable(port):
                claim(port)
                return port
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            claim(port)
            return port
    raise RuntimeError(f"no free port on {HOST}")
