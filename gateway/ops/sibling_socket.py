"""A unix datagram socket per worker, for messages among the workers of one gateway.

The parent makes a private (0700) directory for the workers; each worker binds
``<kind>-<index>.sock`` there and sends to its siblings' paths. Datagrams keep message
boundaries and order, need no connection, and never block here: a sibling whose buffer
is full, or that is gone, costs a counted failure (``send`` returns how many), not a wait.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

__all__ = ["SiblingMessages", "SiblingSocket"]

log = logging.getLogger(__name__)

_MAX_READS = 256  # datagrams per readable event: other work gets the loop between batches


class SiblingSocket:
    def __init__(self, directory: str, kind: str, worker: int, workers: int, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._peer_of = {  # sibling index -> its socket's path
            w: os.path.join(directory, f"{kind}-{w}.sock") for w in range(workers) if w != worker
        }
        self._peers = list(self._peer_of.values())
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        path = os.path.join(directory, f"{kind}-{worker}.sock")
        if os.path.exists(path):
            os.unlink(path)
        self._sock.bind(path)
        self._sock.setblocking(False)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, max(max_bytes, 1 << 16))
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def siblings(self) -> int:
        return len(self._peers)

    @property
    def sibling_indexes(self) -> list[int]:
        return list(self._peer_of)

    def send(self, datagram: bytes, only: int | None = None) -> int:
        """To every sibling (or ``only`` that one); returns how many did not get it (full buffer, gone)."""
        failed = 0
        for peer in self._peers if only is None else [self._peer_of[only]]:
            try:
                self._sock.sendto(datagram, peer)
            except OSError:
                failed += 1
        return failed

    def listen(self, receive: Callable[[bytes], None]) -> None:
        """Call ``receive`` with each datagram as it arrives, on the running loop."""
        self._loop = asyncio.get_running_loop()

        def readable() -> None:
            for _ in range(_MAX_READS):
                try:
                    datagram = self._sock.recv(self.max_bytes)
                except BlockingIOError:
                    return
                receive(datagram)

        self._loop.add_reader(self._sock.fileno(), readable)

    def close(self) -> None:
        if self._sock.fileno() < 0:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()


class SiblingMessages:
    """Small JSON objects to and from the sibling workers, over a :class:`SiblingSocket`.

    What a sibling did not get (full buffer, gone, or too large to send) is counted through
    ``on_drop``; a datagram ``receive`` or JSON rejects (``KeyError``, ``TypeError``, ``ValueError``,
    ``RecursionError``) is logged and dropped: only siblings can write here, so it is a bug, never a crash.
    """

    def __init__(
        self,
        directory: str,
        kind: str,
        worker: int,
        workers: int,
        max_bytes: int,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.kind = kind
        self.directory = directory
        self.worker = worker
        self._socket = SiblingSocket(directory, kind, worker, workers, max_bytes)
        self._on_drop = on_drop

    def listen(self, receive: Callable[[dict[str, Any]], None]) -> None:
        def decoded(datagram: bytes) -> None:
            try:
                message = json.loads(datagram)
                if not isinstance(message, dict):
                    raise TypeError("not an object")
                receive(message)
            except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: deep JSON
                log.warning("%s broadcast: a malformed datagram was dropped", self.kind)

        self._socket.listen(decoded)

    @property
    def sibling_indexes(self) -> list[int]:
        return self._socket.sibling_indexes

    def send(self, message: dict[str, Any], only: int | None = None) -> None:
        """To every sibling, or ``only`` that one."""
        datagram = json.dumps(message, separators=(",", ":")).encode()
        too_large = len(datagram) > self._socket.max_bytes  # then no sibling gets it
        if too_large:
            failed = self._socket.siblings if only is None else 1
        else:
            failed = self._socket.send(datagram, only)
        if failed and self._on_drop is not None:
            for _ in range(failed):
                self._on_drop()

    def close(self) -> None:
        self._socket.close()
