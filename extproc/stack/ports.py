"""Free TCP ports for local runs.

The kernel picks (bind to port 0), so two runs on one host do not collide by construction; the
port is released before the caller binds it, so another process may in principle take it in
between. Where a component can bind port 0 itself and report the port (Envoy's admin and
listeners, aiohttp), prefer that; use these for components that need the number up front.
"""

from __future__ import annotations

import socket

__all__ = ["free_port", "free_port_run", "free_ports"]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Return `count` distinct TCP ports that were free on `host` a moment ago.

    All sockets stay bound until every port is picked, so the ports are distinct.

    Raises:
        ValueError: `count` below 1.
        OSError: `host` cannot be bound.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """Return one TCP port that was free on `host` a moment ago (see `free_ports`)."""
    return free_ports(1, host)[0]


def free_port_run(count: int, host: str = "127.0.0.1", attempts: int = 50) -> int:
    """Return the first of `count` consecutive TCP ports that were all free on `host` a moment
    ago (for `serve --workers N`, whose worker i listens on port + i).

    Raises:
        ValueError: `count` below 1.
        OSError: no such run found in `attempts` tries.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(attempts):
        base = free_port(host)
        if base + count - 1 > 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket(family, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError(f"no {count} consecutive free ports on {host} in {attempts} tries")
