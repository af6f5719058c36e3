"""Stand-in for the KV transfer fabric of P/D disaggregation.

A prefill replica records what it prefilled (vLLM NixlConnector: keyed by engine id
and request id; SGLang: keyed by bootstrap room) in its process's registry. A decode
replica honours transfer params only if they name a live, recent prefill of the same
prompt; otherwise it recomputes, which is what misrouted or stale P/D traffic costs on
real engines.

Across processes the decode replica asks the prefill replica the params point at, as
the real protocols do:

- vLLM: ``POST http://{remote_host}:{remote_port}/internal/pd/claim`` with
  ``{engine_id, request_id, block_ids, digest}`` -> ``{"ok": bool}`` (one-shot);
- SGLang: the prefill replica serves its "bootstrap server" on its HTTP port:
  ``GET http://{bootstrap_host}:{bootstrap_port}/internal/pd/room/{room}?digest=D&wait_s=W``
  long-polls up to W seconds -> ``{"status": "honoured" | "mismatch" | "absent"}``;
  a room is consumed by its first claim.

Sims in one process share `REGISTRY`, so a decode replica finds a same-process prefill
without any HTTP round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import xxhash

__all__ = ["REGISTRY", "PDRegistry", "PrefillRecord", "prompt_digest"]


def prompt_digest(tokens: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in tokens))


@dataclass
class PrefillRecord:
    engine_id: str
    request_id: str
    block_ids: list[int]
    digest: int
    num_tokens: int
    expires: float = field(default=0.0)


class PDRegistry:
    def __init__(self) -> None:
        self.engines: set[str] = set()
        self._prefills: dict[tuple[str, str], PrefillRecord] = {}
        self._rooms: dict[int, PrefillRecord] = {}
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, r in self._prefills.items() if r.expires < now]:
            del self._prefills[key]
        for room in [k for k, r in self._rooms.items() if r.expires < now]:
            del self._rooms[room]

    def add_prefill(self, rec: PrefillRecord, room: int | None = None) -> None:
        self._expire()
        self._prefills[(rec.engine_id, rec.request_id)] = rec
        if room is not None:
            self._rooms[room] = rec
            for fut in self._waiters.pop(room, []):
                if not fut.done():
                    with contextlib.suppress(RuntimeError):  # its loop is gone
                        fut.set_result(None)

    # -- vLLM NixlConnector ------------------------------------------------------------
    def claim(self, engine_id: Any, request_id: Any, block_ids: Any, digest: Any) -> bool:
        """One-shot claim of a prefill by its identity; False if it is not a live match."""
        self._expire()
        if not isinstance(engine_id, str) or engine_id not in self.engines or not isinstance(request_id, str):
            return False
        rec = self._prefills.get((engine_id, request_id))
        if rec is None or block_ids != rec.block_ids or rec.digest != digest:
            return False
        del self._prefills[(engine_id, request_id)]
        return True

    def claim_nixl(self, params: dict[str, Any], tokens: list[int]) -> bool:
        """One-shot claim of a NixlConnector prefill; False if the params do not match a live prefill."""
        return self.claim(
            params.get("remote_engine_id"),
            params.get("remote_request_id"),
            params.get("remote_block_ids"),
            prompt_digest(tokens),
        )

    # -- SGLang bootstrap rooms -----------------------------------------------------------
    def take_room(self, room: Any, engine_id: str | None = None) -> PrefillRecord | None:
        """Remove and return the prefill of `room` (of `engine_id` only, if given); None if absent."""
        self._expire()
        rec = self._rooms.get(room)
        if rec is None or (engine_id is not None and rec.engine_id != engine_id):
            return None
        del self._rooms[room]
        self._prefills.pop((rec.engine_id, rec.request_id), None)
        return rec

    def claim_room(self, room: Any, tokens: list[int]) -> bool | None:
        """True: room prefilled with this prompt; False: room holds another prompt; None: not there (yet)."""
        rec = self.take_room(room)
        if rec is None:
            return None
        return rec.digest == prompt_digest(tokens)

    async def wait_room(
        self, room: Any, timeout_s: float, engine_id: str | None = None
    ) -> PrefillRecord | None:
        """`take_room`, waiting up to `timeout_s` for the prefill to land."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            rec = self.take_room(room, engine_id)
            remaining = deadline - time.monotonic()
            if rec is not None or remaining <= 0:
                return rec
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(room, []).append(fut)
            try:
                # Re-checked at least every 50 ms: a room of another engine wakes us too.
                await asyncio.wait_for(fut, min(remaining, 0.05))
            except TimeoutError:
                pass
            finally:
                waiters = self._waiters.get(room)
                if waiters is not None:
                    with contextlib.suppress(ValueError):
                        waiters.remove(fut)
                    if not waiters:
                        del self._waiters[room]


REGISTRY = PDRegistry()
