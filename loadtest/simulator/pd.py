"""Process-wide registry standing in for the KV transfer fabric of P/D disaggregation.

A prefill replica records what it prefilled (vLLM NixlConnector: keyed by engine id
and request id; SGLang: keyed by bootstrap room). A decode replica honours transfer
params only if they name a live, recent prefill of the same prompt; otherwise it
recomputes, which is what misrouted or stale P/D traffic costs on real engines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import xxhash


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

    def claim_nixl(self, params: dict[str, Any], tokens: list[int]) -> bool:
        """One-shot claim of a NixlConnector prefill; False if the params do not match a live prefill."""
        self._expire()
        engine_id = params.get("remote_engine_id")
        request_id = params.get("remote_request_id")
        if not isinstance(engine_id, str) or engine_id not in self.engines or not isinstance(request_id, str):
            return False
        rec = self._prefills.get((engine_id, request_id))
        if (
            rec is None
            or params.get("remote_block_ids") != rec.block_ids
            or rec.digest != prompt_digest(tokens)
        ):
            return False
        del self._prefills[(engine_id, request_id)]
        return True

    def claim_room(self, room: int, tokens: list[int]) -> bool | None:
        """True: room prefilled with this prompt; False: room holds another prompt; None: not there (yet)."""
        self._expire()
        rec = self._rooms.get(room)
        if rec is None:
            return None
        del self._rooms[room]
        self._prefills.pop((rec.engine_id, rec.request_id), None)
        return rec.digest == prompt_digest(tokens)


REGISTRY = PDRegistry()
