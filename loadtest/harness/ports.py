"""Free loopback ports: the one place a benchmark or a test asks the kernel for one."""

from __future__ import annotations

import socket

__all__ = ["free_port", "free_port_block", "free_ports"]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Distinct free ports on ``host`` (held open together so they cannot repeat)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One free port on ``host``."""
    return free_ports(1, host)[0]


def free_port_block(count: int, host: str = "127.0.0.1", tries: int = 200) -> int:
    """The first of ``count`` consecutive free ports on ``host`` (all were bindable together).

    For what binds ``port + rank`` per data-parallel rank, as vLLM's KV-event publishers do:
    distinct free ports from :func:`free_ports` are often neighbours, so one rank's port could
    be another socket's (a test once failed on exactly that).
    """
    for _ in range(tries):
        base = free_port(host)
        if base + count > 65536:
            continue
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise OSError(f"no {count} consecutive free ports on {host} in {tries} tries")
