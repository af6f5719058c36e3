"""A KV-event publisher that replays as vLLM 0.32's does, on its own thread.

vLLM serves replays from a thread with a plain ROUTER socket and the default send limit
(1,000 queued messages); a ROUTER drops, silently, what does not fit. This one is the same
shape: a PUB socket for live batches, a ROUTER answering ``[ident, b"", b"", seq, payload]``
per buffered batch from the asked ``start``, then seq -1, sent without waiting. ``drop``
decides per (replay request, seq) to leave a batch out (seq -1: the end marker), so tests can
place holes exactly.
Being on its own thread, it never shares the subscriber's event loop (the simulator's
publisher does, which would hide a subscriber that holds the loop).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

__all__ = ["ThreadedPublisher", "seq_frame"]


def _bind(socket: zmq.Socket, port: int | None) -> int:
    """``port`` (a restarted publisher's), or one the kernel picks: never a port chosen and
    then bound, which another process can take in between."""
    if port:
        socket.bind(f"tcp://127.0.0.1:{port}")
        return port
    return socket.bind_to_random_port("tcp://127.0.0.1")


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class ThreadedPublisher:
    def __init__(self, pub_port: int | None = None, replay_port: int | None = None) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub_port = _bind(self.pub, pub_port)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.replay_port = _bind(self.router, replay_port)
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replays = 0
        self.drop: Callable[[int, int], bool] = lambda request, seq: False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-replayer", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(50)):
                continue
            ident, _, start = self.router.recv_multipart()
            request, self.replays = self.replays, self.replays + 1
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first and not self.drop(request, seq):
                    self.router.send_multipart([ident, b"", b"", seq_frame(seq), payload])
            if not self.drop(request, -1):  # the end marker too
                self.router.send_multipart([ident, b"", b"", seq_frame(-1), b""])

    def send(self, payload: bytes, seq: int | None = None, keep: bool = True) -> None:
        """Publish a batch (at ``seq``, or the next one); ``keep``: also buffer it for replays."""
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        if keep:
            self.buffer.append((seq, payload))
        self.pub.send_multipart([b"", seq_frame(seq), payload])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.router.close(0)
        self.pub.close(0)
        self.ctx.term()
