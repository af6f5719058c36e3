"""A replacement worker's catch-up: its siblings write what they hold to a file for it.

Why: a worker started in place of a dead or hung one begins with empty memory stores, while
its siblings hold every record broadcast before it started (Responses API records, session
pins). With auth on, a Responses chain whose id the new worker does not know is answered
404 (its owner cannot be told, so the replicas are never asked): every connection the kernel
gives the new worker would break the conversations made before it started.

The exchange rides on the store's own :class:`~gateway.ops.sibling_socket.SiblingMessages`.
The new worker ``i`` asks one sibling, ``{"catch_up": i, "n": <its pid>}`` (every sibling holds
the same records, and a file per sibling would cost each of them, the new worker and the
shared directory a copy of the whole store); if none has answered after ``ASK_ALL_AFTER_S``
(that sibling is hung or gone), it asks all the others. A sibling ``j`` copies its keys (one
C-level copy), encodes them as lines of JSON arrays, ``CHUNK`` records a line, letting the
event loop go between lines and appending each line in a thread, renames the file to
``<kind>-catch-up-<j>-to-<i>-<pid>`` in the gateway's private directory, and sends
``{"caught_up": j, "to": i, "n": <pid>}``. Worker ``i`` takes only files for its own pid (an
earlier, dead worker of its slot asked with another), applies the records it has no newer
copy of, a line at a time, and removes the file; one answer at a time. The parent removes
what a dead worker leaves (:func:`remove_files_of`). Nothing waits for the exchange: the new
worker serves while it catches up, and if no sibling answers it stays where it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from gateway.ops.sibling_socket import SiblingMessages

__all__ = ["ASK_ALL_AFTER_S", "CHUNK", "CatchUp", "remove_files_of"]

log = logging.getLogger(__name__)

CHUNK = 10_000  # records per line of the file, and per slice of the event loop on either side
ASK_ALL_AFTER_S = 10.0  # no answer from the sibling asked first: every other one is asked
_NONCE = re.compile(r"^[0-9]{1,10}$")


class CatchUp:
    """One store's side of the exchange, in one worker.

    ``keys`` copies the keys of the store's entries (references only: a million new objects
    would cost the event loop a full garbage collection); ``encode`` turns the entry of one
    into a JSON-able list (None: gone since), and ``apply`` takes one such list back (a row it
    raises on is skipped and counted); ``on_done`` runs once an answer has been applied.
    """

    def __init__(
        self,
        siblings: SiblingMessages,
        keys: Callable[[], Sequence[Any]],
        encode: Callable[[Any], list[Any] | None],
        apply: Callable[[list[Any]], None],
        on_done: Callable[[], None] | None = None,
    ) -> None:
        self._directory = Path(siblings.directory)
        self._kind = siblings.kind
        self._worker = siblings.worker
        self._siblings = siblings
        self._keys = keys
        self._encode = encode
        self._apply = apply
        self._on_done = on_done
        self._tasks: set[asyncio.Task[None]] = set()
        self._nonce = str(os.getpid())
        self._answered = False
        self._taking = asyncio.Lock()  # one sibling's file in memory at a time
        self._ask_all: asyncio.TimerHandle | None = None
        self.applied = 0  # records taken from siblings' files (for tests and logs)

    def request(self) -> None:
        """Ask a sibling for what it holds (a replacement, once it listens to them); all of the
        others if it has not answered in ``ASK_ALL_AFTER_S``."""
        siblings = self._siblings.sibling_indexes
        if not siblings:
            return
        ask = {"catch_up": self._worker, "n": self._nonce}
        self._siblings.send(ask, only=siblings[0])
        if len(siblings) > 1:

            def ask_the_others() -> None:
                if not self._answered:
                    log.warning(
                        "%s catch-up: worker %d did not answer; asking the others", self._kind, siblings[0]
                    )
                    for sibling in siblings[1:]:
                        self._siblings.send(ask, only=sibling)

            self._ask_all = asyncio.get_running_loop().call_later(ASK_ALL_AFTER_S, ask_the_others)

    def handle(self, message: dict[str, Any]) -> bool:
        """Whether ``message`` belongs to the exchange (then it is dealt with here)."""
        if "catch_up" in message:
            requester, nonce = message["catch_up"], message.get("n")
            if (
                type(requester) is not int
                or requester not in self._siblings.sibling_indexes
                or not _nonce_ok(nonce)
            ):
                raise TypeError("catch_up")
            self._spawn(self._answer(requester, nonce), f"answering worker {requester}")
            return True
        if "caught_up" in message:
            sender, to, nonce = message["caught_up"], message.get("to"), message.get("n")
            if type(sender) is not int or type(to) is not int or not _nonce_ok(nonce):
                raise TypeError("caught_up")
            if to == self._worker and nonce == self._nonce:
                self._answered = True
                self._spawn(self._take(sender), f"taking worker {sender}'s file")
            return True
        return False

    def _path(self, sender: int, requester: int, nonce: str) -> Path:
        return self._directory / f"{self._kind}-catch-up-{sender}-to-{requester}-{nonce}"

    async def _answer(self, requester: int, nonce: str) -> None:
        keys = self._keys()
        path = self._path(self._worker, requester, nonce)
        partial = path.with_name(path.name + ".partial")
        encoder = msgspec.json.Encoder()
        try:
            partial.unlink(missing_ok=True)  # what an answer to the same request left (appended to)
            for start in range(0, len(keys), CHUNK):
                rows = [row for key in keys[start : start + CHUNK] if (row := self._encode(key)) is not None]
                await asyncio.to_thread(_append, partial, encoder.encode(rows) + b"\n")
            if not keys:
                await asyncio.to_thread(_append, partial, b"")
            os.replace(partial, path)
        except BaseException:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise
        self._siblings.send({"caught_up": self._worker, "to": requester, "n": nonce}, only=requester)
        log.info("%s: %d records written for worker %d", self._kind, len(keys), requester)

    async def _take(self, sender: int) -> None:
        path = self._path(sender, self._worker, self._nonce)
        async with self._taking:
            try:
                lines = await asyncio.to_thread(_read_lines, path)
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
                    except Exception:  # a malformed row costs itself only
                        skipped += 1
                await asyncio.sleep(0)
            del lines
        self.applied += applied
        if self._on_done is not None:
            self._on_done()
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
        if self._ask_all is not None:
            self._ask_all.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _rows(decoder: msgspec.json.Decoder[list[list[Any]]], line: bytes) -> Iterator[list[Any]]:
    try:
        rows = decoder.decode(line)
    except (msgspec.DecodeError, RecursionError):  # RecursionError: nested past msgspec's depth
        log.warning("catch-up: a malformed line was skipped")
        return
    yield from rows


def _nonce_ok(nonce: object) -> bool:
    return isinstance(nonce, str) and _NONCE.match(nonce) is not None


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as file:
        file.write(data)


def _read_lines(path: Path) -> list[bytes]:
    with open(path, "rb") as file:
        return file.readlines()


def remove_files_of(directory: str, worker: int) -> None:
    """A worker died: the files answered to it (nobody will read them) and any it was writing."""
    base = Path(directory)
    for path in [*base.glob(f"*-catch-up-*-to-{worker}-*"), *base.glob(f"*-catch-up-{worker}-to-*")]:
        with contextlib.suppress(OSError):
            path.unlink()
