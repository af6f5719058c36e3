"""Chained block hashes of a canonical prompt: equal hash ⇔ equal prefix (for the same model).

The prompt's UTF-8 bytes are cut into fixed-size blocks (default 64 bytes ≈ 16
tokens, vLLM's default block). Block ``i``'s hash is the xxh3-64 digest of the model
name and every byte up to the end of block ``i`` — computed incrementally with one
streaming hasher, which is the chained (parent, block) hash without re-hashing.
The trailing partial block is not indexed: an engine caches only full blocks too.
Cost is linear in the prompt length, once per request, and bounded: at most
``max_blocks`` blocks are hashed (no engine caches a prefix longer than its context,
so hashing a 15 MB prompt to the end only stalls the event loop).
"""

from __future__ import annotations

import xxhash

__all__ = ["DEFAULT_BLOCK_BYTES", "MODEL_SEPARATOR", "block_hashes", "prompt_bytes"]

DEFAULT_BLOCK_BYTES = 64
MODEL_SEPARATOR = b"\x00"


def prompt_bytes(prompt: str, block_bytes: int, max_blocks: int | None) -> bytes:
    """The bytes hashed: the prompt's UTF-8, at most ``max_blocks`` blocks of it."""
    if max_blocks is None:
        return prompt.encode("utf-8", "surrogatepass")
    limit = max_blocks * block_bytes
    # A character is at least one byte: cutting the text first keeps every needed byte.
    return prompt[:limit].encode("utf-8", "surrogatepass")[:limit]


def block_hashes(
    model: str, prompt: str, block_bytes: int = DEFAULT_BLOCK_BYTES, max_blocks: int | None = None
) -> list[int]:
    data = prompt_bytes(prompt, block_bytes, max_blocks)
    hasher = xxhash.xxh3_64(model.encode("utf-8", "surrogatepass") + MODEL_SEPARATOR)
    update, digest = hasher.update, hasher.intdigest
    view = memoryview(data)
    hashes: list[int] = []
    append = hashes.append
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        update(view[start : start + block_bytes])
        append(digest())
    return hashes
