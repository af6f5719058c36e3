"""A replacement worker's catch-up: its siblings write what they hold to a file for it.

Why: a worker started in place of a dead or hung one begins with empty memory stores, while
its siblings hold every record broadcast before it started (Responses API records, session
pins). With auth on, a Responses chain whose id the new worker does not know is answered
404 (its owner cannot be told, so the replicas are never asked): every connection the kernel
gives the new worker would break the conversations made before it started.

The exchange rides on the store's own :class:`~gateway.ops.sibling_socket.SiblingMessages`.
The new worker sends ``{"catch_up": i}``. Each sibling ``j`` copies its keys (one C-level
copy), encodes them as lines of JSON arrays, ``CHUNK`` records a line, letting the event loop
go between lines, writes them (in a thread) to ``<kind>-catch-up-<j>-to-<i>`` in the gateway's
private directory, and sends ``{"caught_up": j, "to": i}``. Worker ``i`` reads the file, applies
the records it has no newer copy of, a line at a time, and removes it. Nothing waits for the
exchange: the new worker serves while it catches up, and a sibling that never answers (hung,
gone) leaves it where it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from gateway.ops.shared_files import write_whole
from gateway.ops.sibling_socket import SiblingMessages

__all__ = ["CHUNK", "CatchUp"]

log = logging.getLogger(__name__)

CHUNK = 10_000  # records per line of the file, and per slice of the event loop on either side


class CatchUp:
    """One store's side of the exchange, in one worker.

    ``keys`` copies the keys of the store's entries (references only: a million new objects
    would cost the event loop a full garbage collection); ``encode`` turns the entry of one
    into a JSON-able list (None: gone since), and ``apply`` takes one such list back (it raises
    ``TypeError`` or ``ValueError`` on a malformed one, which is then skipped).
    """

    def __init__(
        self,
        siblings: SiblingMessages,
        keys: Callable[[], Sequence[Any]],
        encode: Callable[[Any], list[Any] | None],
        apply: Callable[[list[Any]], None],
    ) -> None:
        self._directory = Path(siblings.directory)
        self._kind = siblings.kind
        self._worker = siblings.worker
        self._siblings = siblings
        self._keys = keys
        self._encode = encode
        self._apply = apply
        self._tasks: set[asyncio.Task[None]] = set()
        self.applied = 0  # records taken from siblings' files (for tests and logs)

    def request(self) -> None:
        """Ask every sibling for what it holds (a replacement, once it listens to them)."""
        self._siblings.send({"catch_up": self._worker})

    def handle(self, message: dict[str, Any]) -> bool:
        """Whether ``message`` belongs to the exchange (then it is dealt with here)."""
        if "catch_up" in message:
            requester = message["catch_up"]
            if not isinstance(requester, int) or requester == self._worker:
                raise TypeError("catch_up")
            self._spawn(self._answer(requester), f"answering worker {requester}")
            return True
        if "caught_up" in message:
            sender, to = message["caught_up"], message.get("to")
            if not isinstance(sender, int) or not isinstance(to, int):
                raise TypeError("caught_up")
            if to == self._worker:
                self._spawn(self._take(sender), f"taking worker {sender}'s file")
            return True
        return False

    def _path(self, sender: int, requester: int) -> Path:
        return self._directory / f"{self._kind}-catch-up-{sender}-to-{requester}"

    async def _answer(self, requester: int) -> None:
        keys = self._keys()
        encoder = msgspec.json.Encoder()
        lines = []
        for start in range(0, len(keys), CHUNK):
            rows = [row for key in keys[start : start + CHUNK] if (row := self._encode(key)) is not None]
            lines.append(encoder.encode(rows))
            await asyncio.sleep(0)
        await asyncio.to_thread(write_whole, self._path(self._worker, requester), b"\n".join(lines))
        self._siblings.send({"caught_up": self._worker, "to": requester})
        log.info("%s: %d records written for worker %d", self._kind, len(keys), requester)

    async def _take(self, sender: int) -> None:
        path = self._path(sender, self._worker)
        try:
            lines = (await asyncio.to_thread(path.read_bytes)).splitlines()
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
        decoder = msgspec.json.Decoder(list[list[Any]])
        applied = skipped = 0
        for line in lines:
            for row in _rows(decoder, line):
                try:
                    self._apply(row)
                    applied += 1
                except (TypeError, ValueError, IndexError):
                    skipped += 1
            await asyncio.sleep(0)
        self.applied += applied
        log.info(
            "%s: caught up from worker %d (%d records, %d malformed)", self._kind, sender, applied, skipped
        )

    def _spawn(self, work: Any, what: str) -> None:
        task = asyncio.get_running_loop().create_task(self._logged(work, what))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _logged(self, work: Any, what: str) -> None:
        """One exchange; a failure (a full disk, a file gone) is logged: the worker goes on
        with what it has, as without the exchange."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s catch-up: %s failed", self._kind, what)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _rows(decoder: msgspec.json.Decoder[list[list[Any]]], line: bytes) -> Iterator[list[Any]]:
    try:
        yield from decoder.decode(line)
    except msgspec.DecodeError:
        log.warning("catch-up: a malformed line was skipped")
