"""A ZeroMQ context that can never hang the process when it is garbage collected.

pyzmq's ``Context.__del__`` closes the sockets it still knows (weak references) and then
terminates, and termination waits for every socket of the context to be closed. When a
context and its open sockets become garbage together (a reference cycle: an abandoned
subscriber, a task dropped with its loop), the collector clears weak references before it
runs finalizers: the context sees no socket to close, and ``term()`` waits forever, with the
event loop and every request stopped behind it (a test run hung so, for an hour, inside an
unrelated ``aiohttp`` call that happened to trigger a collection).

:class:`OwnedContext` keeps strong references to its open sockets, which stay valid while
finalizers run, and closes them itself before terminating.
"""

from __future__ import annotations

import contextlib
import resource
from typing import Any

import zmq
import zmq.asyncio

__all__ = ["OwnedContext"]

_MOST_SOCKETS = 65536


class OwnedContext(zmq.asyncio.Context):
    _open: list[Any] | None = None  # declared on the class: pyzmq takes other attributes for options

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._open = []
        # libzmq allows 1,023 sockets by default and a KV-event stream takes ~3 (SUB, its monitor
        # and the monitor's pair; a replay a DEALER more): ~340 streams. Allow what the
        # process's descriptors allow instead (each socket holds at least one).
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY or soft > _MOST_SOCKETS:
            soft = _MOST_SOCKETS
        self.set(zmq.MAX_SOCKETS, max(soft, 1024))

    def socket(self, socket_type: int, *args: Any, **kwargs: Any) -> Any:
        sock = super().socket(socket_type, *args, **kwargs)
        self._open = [s for s in self._open or () if not s.closed]  # bounded by the sockets open now
        self._open.append(sock)
        return sock

    def destroy(self, linger: int | None = 0) -> None:
        """Close every socket this context made (``linger`` 0 by default), then terminate."""
        if self.closed:
            return
        sockets, self._open = self._open or [], []
        for sock in sockets:
            if not sock.closed:
                with contextlib.suppress(Exception):  # a closed event loop, a socket torn down already
                    sock.close(linger=linger)
        super().destroy(linger=linger)

    def __del__(self) -> None:
        if not getattr(self, "closed", True) and getattr(self, "_open", None) is not None:
            self.destroy(linger=0)
