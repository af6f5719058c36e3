"""One contract suite for every PrefixIndex backend: the in-memory LRU and Redis (real server).

For Redis, every ``match`` must be answered by Redis itself: the index is built with a
generous budget and the suite fails on any fallback, so the local mirror cannot make a
Redis bug pass unnoticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import pytest
import redis
import redis.asyncio as aioredis
from redis.crc import key_slot

from gateway.prefix.hashing import block_hashes
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.prefix.redis import RedisPrefixIndex, endpoint_key
from tests.prefix.conftest import scan_keys

MODEL = "contract-model"
B = 64


def prompt_hashes(tag: str, blocks: int, model: str = MODEL) -> list[int]:
    text = "".join(f"<{tag}:{i:05d}>".ljust(B, ".") for i in range(blocks))
    hashes = block_hashes(model, text, B)
    assert len(hashes) == blocks
    return hashes


@dataclass
class Backend:
    kind: str
    index: MemoryPrefixIndex | RedisPrefixIndex
    redis_url: str | None = None
    key_prefix: str | None = None
    fallbacks: list[str] = field(default_factory=list)

    async def record(self, hashes: Sequence[int], endpoint: str, model: str = MODEL) -> None:
        self.index.record(hashes, endpoint, model)
        if isinstance(self.index, RedisPrefixIndex):
            await self.index.flush()

    async def match(
        self, hashes: Sequence[int], endpoints: Sequence[str], model: str = MODEL
    ) -> dict[str, int]:
        return await self.index.match(hashes, endpoints, model)

    def zcard(self, endpoint: str, model: str = MODEL) -> int:
        assert self.redis_url is not None and self.key_prefix is not None
        client = redis.Redis.from_url(self.redis_url)
        try:
            return int(client.zcard(endpoint_key(self.key_prefix, model, endpoint)))
        finally:
            client.close()

    def stored(self, endpoint: str, model: str = MODEL) -> int:
        """Entries the backend's shared store holds for ``endpoint`` (ZCARD for Redis)."""
        if self.kind == "redis":
            return self.zcard(endpoint, model)
        return self.index.size(endpoint)


@contextlib.asynccontextmanager
async def make_backend(
    kind: str, redis_url: str, key_prefix: str, *, capacity: int = 65536, ttl_s: float = 3600.0
) -> AsyncIterator[Backend]:
    local = MemoryPrefixIndex(default_capacity=capacity, ttl_s=ttl_s)
    if kind == "memory":
        yield Backend(kind, local)
        return
    fallbacks: list[str] = []
    index = RedisPrefixIndex(
        aioredis.from_url(redis_url),
        local,
        key_prefix=key_prefix,
        budget_s=2.0,
        retry_after_s=0.01,
        on_fallback=fallbacks.append,
    )
    backend = Backend(kind, index, redis_url, key_prefix, fallbacks)
    try:
        yield backend
    finally:
        await index.close()
    assert fallbacks == [], f"Redis did not answer: fallbacks {fallbacks}"


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param == "redis":
        redis_url = request.getfixturevalue("redis_url")
        prefix = request.getfixturevalue("key_prefix")
    else:
        redis_url, prefix = "", ""
    async with make_backend(request.param, redis_url, prefix) as b:
        yield b


@pytest.fixture(params=["memory", "redis"])
def backend_factory(request: pytest.FixtureRequest):
    """``async with backend_factory(capacity=..., ttl_s=...) as b`` for tests needing other settings."""
    if request.param == "redis":
        redis_url = request.getfixturevalue("redis_url")
        prefix = request.getfixturevalue("key_prefix")
    else:
        redis_url, prefix = "", ""

    def make(**kw: float) -> contextlib.AbstractAsyncContextManager[Backend]:
        return make_backend(request.param, redis_url, prefix, **kw)  # type: ignore[arg-type]

    make.kind = request.param  # type: ignore[attr-defined]
    return make


# -- matching -------------------------------------------------------------------------------


async def test_longest_prefix_per_endpoint(backend: Backend):
    a = prompt_hashes("conv", 12)
    await backend.record(a[:4], "e1")
    await backend.record(a[:9], "e2")
    await backend.record(a, "e3")
    assert await backend.match(a, ["e1", "e2", "e3"]) == {"e1": 4, "e2": 9, "e3": 12}
    # a shorter query is capped by its own length
    assert await backend.match(a[:6], ["e1", "e2", "e3"]) == {"e1": 4, "e2": 6, "e3": 6}
    # endpoint order in the answer does not matter, each is answered for itself
    assert await backend.match(a, ["e3", "e1"]) == {"e3": 12, "e1": 4}


async def test_no_false_positives(backend: Backend):
    a = prompt_hashes("known", 6)
    await backend.record(a, "e1")
    result = await backend.match(a, ["e1", "never-recorded", "e2"])
    assert result == {"e1": 6, "never-recorded": 0, "e2": 0}
    # unrelated prompt on a recorded endpoint
    assert await backend.match(prompt_hashes("unknown", 6), ["e1"]) == {"e1": 0}
    # same text under another model is another prefix
    assert await backend.match(prompt_hashes("known", 6, model="other"), ["e1"], model="other") == {"e1": 0}
    # empty query
    assert await backend.match([], ["e1"]) == {"e1": 0}


async def test_partial_overlap_diverging_suffix(backend: Backend):
    head = "<shared system prompt>".ljust(5 * B, "~")
    a = block_hashes(MODEL, head + "user asks about apples. " * 12, B)
    b = block_hashes(MODEL, head + "user asks about oranges! " * 12, B)
    assert a[:5] == b[:5] and a[5] != b[5]
    await backend.record(a, "e1")
    assert (await backend.match(b, ["e1"]))["e1"] == 5
    assert (await backend.match(a, ["e1"]))["e1"] == len(a)
    # a gap in the middle (a later block recorded, an earlier one not) is not a hit
    c = prompt_hashes("gap", 6)
    await backend.record(c[:2], "e2")
    await backend.record(c, "e3")
    assert await backend.match(c, ["e2", "e3"]) == {"e2": 2, "e3": 6}


# -- bounded LRU ----------------------------------------------------------------------------


async def test_lru_bound_under_flood_keeps_recent_prefix(backend_factory):
    capacity = 40
    async with backend_factory(capacity=capacity) as b:
        old = prompt_hashes("old", 6)
        hot = prompt_hashes("hot", 6)
        await b.record(old, "e1")
        await b.record(hot, "e1")
        for i in range(60):  # 60 × 3 blocks = 180 unique blocks through a 40-block index
            await b.record(prompt_hashes(f"flood-{i}", 3), "e1")
            if i % 5 == 0:
                await b.record(hot, "e1")  # the hot prefix keeps being used
            assert b.index.size("e1") <= capacity
            assert b.stored("e1") <= capacity
        await b.record(hot, "e1")
        assert b.index.size("e1") == capacity
        assert b.stored("e1") == capacity
        assert await b.match(hot, ["e1"]) == {"e1": 6}
        assert await b.match(old, ["e1"]) == {"e1": 0}


async def test_eviction_is_leaf_first(backend_factory):
    capacity = 20
    async with backend_factory(capacity=capacity) as b:
        long = prompt_hashes("long", 8)
        await b.record(long, "e1")
        for i in range(capacity - 8):  # fill up exactly
            await b.record(prompt_hashes(f"fill-{i}", 1), "e1")
        assert await b.match(long, ["e1"]) == {"e1": 8}
        for i in range(3):  # three more single blocks push out the three oldest entries
            await b.record(prompt_hashes(f"more-{i}", 1), "e1")
        # the tail of the long prefix went first, its head is still matched
        assert await b.match(long, ["e1"]) == {"e1": 5}
        assert b.stored("e1") == capacity
        for i in range(4):
            await b.record(prompt_hashes(f"even-more-{i}", 1), "e1")
        assert await b.match(long, ["e1"]) == {"e1": 1}


async def test_set_capacity_trims(backend_factory):
    async with backend_factory(capacity=100) as b:
        first = prompt_hashes("first", 10)
        second = prompt_hashes("second", 10)
        await b.record(first, "e1")
        await b.record(second, "e1")
        assert b.stored("e1") == 20
        b.index.set_capacity("e1", 12)
        if hasattr(b.index, "flush"):
            await b.index.flush()  # the Redis trim runs in the background, like every write
        assert b.index.capacity("e1") == 12
        assert b.index.size("e1") == 12
        assert await b.match(second, ["e1"]) == {"e1": 10}
        assert await b.match(first, ["e1"]) == {"e1": 2}  # leaf-first: the head of 'first' survives
        assert b.stored("e1") == 12


async def test_capacity_applies_to_later_records(backend_factory):
    async with backend_factory(capacity=100) as b:
        b.index.set_capacity("e1", 12)
        b.index.set_capacity("e2", 0)  # clamped to 1, never 0 or negative
        assert b.index.capacity("e2") == 1
        await b.record(prompt_hashes("first", 10), "e1")
        await b.record(prompt_hashes("second", 10), "e1")
        await b.record(prompt_hashes("third", 5), "e2")
        assert b.index.size("e1") == b.stored("e1") == 12
        assert b.index.size("e2") == b.stored("e2") == 1
        assert await b.match(prompt_hashes("third", 5), ["e2"]) == {"e2": 1}


# -- forgetting -----------------------------------------------------------------------------


async def test_purge_removes_one_endpoint(backend: Backend):
    a = prompt_hashes("purge", 7)
    await backend.record(a, "e1")
    await backend.record(a, "e2")
    await backend.index.purge("e1", (MODEL,))
    assert await backend.match(a, ["e1", "e2"]) == {"e1": 0, "e2": 7}
    assert backend.index.size("e1") == 0
    assert backend.stored("e1") == 0
    assert backend.stored("e2") == 7
    # recording again after a purge works
    await backend.record(a[:3], "e1")
    assert await backend.match(a, ["e1"]) == {"e1": 3}


async def test_purge_without_models_forgets_every_model(backend: Backend):
    a = prompt_hashes("m1-text", 4, model="m1")
    b = prompt_hashes("m2-text", 4, model="m2")
    await backend.record(a, "e1", model="m1")
    await backend.record(b, "e1", model="m2")
    await backend.index.purge("e1")
    assert await backend.match(b, ["e1"], model="m2") == {"e1": 0}
    assert await backend.match(a, ["e1"], model="m1") == {"e1": 0}


async def test_ttl_expiry(backend_factory):
    async with backend_factory(ttl_s=0.3) as b:
        stale = prompt_hashes("stale", 5)
        await b.record(stale, "e1")
        assert await b.match(stale, ["e1"]) == {"e1": 5}
        await asyncio.sleep(0.2)
        fresh = prompt_hashes("fresh", 5)
        await b.record(fresh, "e1")
        await asyncio.sleep(0.2)  # 'stale' is 0.4 s old, 'fresh' 0.2 s
        assert await b.match(stale, ["e1"]) == {"e1": 0}
        assert await b.match(fresh, ["e1"]) == {"e1": 5}
        await asyncio.sleep(0.25)
        assert await b.match(fresh, ["e1"]) == {"e1": 0}
        if b.kind == "redis":  # the key itself expires too: no garbage left behind

            async def gone() -> bool:
                return b.zcard("e1") == 0

            for _ in range(50):
                if await gone():
                    break
                await asyncio.sleep(0.02)
            assert await gone()


async def test_touch_refreshes_ttl(backend_factory):
    async with backend_factory(ttl_s=0.4) as b:
        a = prompt_hashes("touched", 4)
        await b.record(a, "e1")
        for _ in range(3):
            await asyncio.sleep(0.2)
            await b.record(a, "e1")  # used again: stays fresh although 0.6 s > ttl since first record
        assert await b.match(a, ["e1"]) == {"e1": 4}


# -- Redis only -----------------------------------------------------------------------------


async def test_redis_keys_of_one_model_share_one_hash_tag(redis_url: str, key_prefix: str):
    async with make_backend("redis", redis_url, key_prefix) as b:
        models = ["llama-3.1-8b", "org/Qwen2.5:7b", "odd}name"]
        for model in models:
            for ep in ("10.0.0.1:8000", "10.0.0.2:8000", "replica-c:9000"):
                await b.record(prompt_hashes("tag", 3, model=model), ep, model=model)
        keys = scan_keys(redis_url, key_prefix)
        assert len(keys) == 9
        for model in models:
            mine = [k for k in keys if k.startswith(f"{key_prefix}:{{{model}}}:ep:")]
            assert len(mine) == 3, (model, keys)
            # Redis Cluster hashes only the first {...}: all of one model's keys share a slot,
            # so one script call can read every endpoint's key of a request.
            slots = {key_slot(k.encode()) for k in mine}
            assert len(slots) == 1, (model, mine)
        # and a real match over several endpoints in one call works
        query = prompt_hashes("tag", 3, model=models[0])
        eps = ["10.0.0.1:8000", "10.0.0.2:8000", "replica-c:9000", "nobody:1"]
        expect = {"10.0.0.1:8000": 3, "10.0.0.2:8000": 3, "replica-c:9000": 3, "nobody:1": 0}
        assert await b.match(query, eps, model=models[0]) == expect


async def test_redis_is_shared_between_instances(redis_url: str, key_prefix: str):
    """What one index records, a second index (another gateway, empty local mirror) matches."""
    async with (
        make_backend("redis", redis_url, key_prefix) as writer,
        make_backend("redis", redis_url, key_prefix) as reader,
    ):
        a = prompt_hashes("shared", 9)
        await writer.record(a, "e1")
        await writer.record(a[:4], "e2")
        assert reader.index.size("e1") == 0  # nothing local: the answer can only come from Redis
        assert await reader.match(a, ["e1", "e2", "e3"]) == {"e1": 9, "e2": 4, "e3": 0}


def member(block_hash: int) -> bytes:
    """A ZSET member as documented in gateway/prefix/redis.py: the 8-byte big-endian hash."""
    return struct.pack(">Q", block_hash)


async def test_redis_shared_root_never_older_than_its_tail(redis_url: str, key_prefix: str):
    """A long prompt and, right after it, a short one sharing its first two blocks.

    The long prompt has 30 000 blocks, so its leaf-first offsets span 30 ms; the two
    background writes are stamped back to back (~2 ms apart here), well inside that window.
    Two gateways whose clocks differ by a few ms hit the same case at any prompt length.
    """
    n = 30_000
    rng = random.Random(7)
    long = [rng.getrandbits(64) for _ in range(n)]
    short = [*long[:2], rng.getrandbits(64)]
    async with make_backend("redis", redis_url, key_prefix) as b:
        await b.record([rng.getrandbits(64)], "warm-up")  # script loaded: the writes below go straight out
        b.index.record(long, "e1", MODEL)
        b.index.record(short, "e1", MODEL)  # the same conversation's root, used again
        await b.index.flush()
        key = endpoint_key(key_prefix, MODEL, "e1")
        client = redis.Redis.from_url(redis_url)
        try:
            scores = [client.zscore(key, member(h)) for h in long[:4]]
            assert None not in scores
            # what that costs: trim to the 1000 most recent entries (as a smaller capacity would)
            b.index.set_capacity("e1", 1000)
            b.index.record([rng.getrandbits(64)], "e1", MODEL)
            await b.index.flush()
            present = [client.zscore(key, member(h)) is not None for h in long[:1000]]
        finally:
            client.close()
        true_prefix = present.index(False) if False in present else len(present)
        matched = (await b.match(long, ["e1"]))["e1"]
        assert matched <= true_prefix, f"claims {matched} blocks, holds the first {true_prefix}; {scores=}"
        # "a parent is always at least as recent as its children" (module docstring)
        assert scores == sorted(scores, reverse=True), scores
