"""The highest prefix-cache hit ratio any routing could get on the requests a run actually sent.

Offline, over the engine's own tokens of each prompt (``/tokenize``, after the run): requests in
the order they were sent, each hitting the longest run of leading full blocks that any earlier
request computed — its prompt, and for the previous turn of the same conversation its answer
too (the engine caches generated blocks; the next turn's prompt holds the answer re-tokenized,
counted up to the previous prompt's length plus the answer's ``completion_tokens``). As in vLLM,
at most ``(len − 1) // block`` blocks of a prompt are hits: its last token is always computed.

That is one cache that never evicts and sees every request: no fleet of caches of any size
behind any router can hit more, so it bounds every arm of :mod:`loadtest.exact_bench` on its
own requests (the answers differ between arms, so each arm has its own ceiling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

__all__ = ["Sent", "ceiling", "engine_tokens"]


@dataclass
class Sent:
    """One request as sent: its conversation, messages, and (once answered) its answer's length."""

    conversation: int
    messages: list[dict[str, str]]
    completion_tokens: int = 0
    tokens: list[int] | None = None


def _chain(tokens: Sequence[int], block: int, count: int) -> list[int]:
    """Keys of the first ``count`` full blocks, each naming its whole prefix (as engine block hashes do)."""
    keys, parent = [], 0
    for start in range(0, count * block, block):
        parent = hash((parent, tuple(tokens[start : start + block])))
        keys.append(parent)
    return keys


def ceiling(sent: Sequence[Sent], block: int) -> tuple[int, int]:
    """(hit tokens, prompt tokens) of ``sent`` behind one never-evicting cache of ``block``-token blocks."""
    cached: set[int] = set()
    answered: dict[int, int] = {}  # conversation → tokens its last turn left cached (prompt + answer)
    hits = queries = 0
    for request in sent:
        tokens = request.tokens or []
        if request.conversation in answered:
            cached.update(_chain(tokens, block, min(len(tokens), answered[request.conversation]) // block))
        keys = _chain(tokens, block, max(0, len(tokens) - 1) // block)
        matched = next((i for i, key in enumerate(keys) if key not in cached), len(keys))
        hits += matched * block
        queries += len(tokens)
        cached.update(_chain(tokens, block, len(tokens) // block))
        answered[request.conversation] = len(tokens) + request.completion_tokens
    return hits, queries


async def engine_tokens(session: aiohttp.ClientSession, url: str, model: str, sent: Sequence[Sent]) -> None:
    """Fill each request's ``tokens`` from the engine at ``url`` (``POST /tokenize``, as the
    gateway asks for a chat prompt's tokens)."""
    for request in sent:
        body: dict[str, Any] = {"model": model, "messages": request.messages}
        async with session.post(url + "/tokenize", json=body) as resp:
            resp.raise_for_status()
            request.tokens = (await resp.json())["tokens"]
