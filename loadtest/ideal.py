"""The ideal prefix-hit ratio of a static workload: every block already sent to the fleet hits.

Computed with the simulator's own tokenizer and chat template, in its block size, so
it is directly comparable with the hit ratio the replicas report. As in vLLM, a
fully cached prompt still recomputes its last block (the engine needs one token to
produce logits), so at most ``floor((n - 1) / block) × block`` tokens can hit.
"""

from __future__ import annotations

from collections.abc import Iterable

from loadtest.simulator.tokenizer import encode, encode_chat
from loadtest.workloads import WorkItem

__all__ = ["ideal_hit_ratio"]


def _tokens(item: WorkItem) -> list[int]:
    if "messages" in item.body:
        return encode_chat(item.body["messages"])
    prompt = item.body["prompt"]
    return encode(prompt if isinstance(prompt, str) else " ".join(map(str, prompt)))


def _chain(tokens: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks (a hash names the whole prefix up to its block)."""
    hashes, parent = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        hashes.append(parent)
    return hashes


def ideal_hit_ratio(items: Iterable[WorkItem], block_size: int) -> float:
    seen: set[int] = set()
    hit = total = 0
    for item in items:
        tokens = _tokens(item)
        total += len(tokens)
        chain = _chain(tokens, block_size)
        cacheable_blocks = max(0, len(tokens) - 1) // block_size
        matched = 0
        for block_hash in chain[:cacheable_blocks]:
            if block_hash not in seen:
                break
            matched += 1
        hit += matched * block_size
        seen.update(chain)
    return hit / total if total else 0.0
