"""``gateway.redis_guard.RedisGuard``: one fallback policy for every Redis backend, on real Redis.

The happy path runs on the shared Redis (127.0.0.1:6379 when it answers, else a private
one); outages run on private ``redis-server`` processes that the tests kill (SIGKILL) or
freeze (SIGSTOP) by PID. Following ``tests/prefix/conftest.py``: with no Redis at all the
tests skip, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from gateway.redis_guard import RedisGuard
from tests.prefix.conftest import key_prefix, redis_servers, redis_url  # noqa: F401  (fixtures)

LOGGER = "gateway.redis_guard"


def guard(**kw) -> tuple[RedisGuard, list[str]]:
    """A guard and the ``on_fallback`` reasons it reports, in order."""
    reasons: list[str] = []
    kw.setdefault("budget_s", 0.5)
    kw.setdefault("retry_after_s", 0.2)
    return RedisGuard("test store", on_fallback=reasons.append, **kw), reasons


@pytest.fixture
async def connect() -> AsyncIterator:
    clients: list[aioredis.Redis] = []

    def make(url: str) -> aioredis.Redis:
        # Connects get 2 s: one slow connect (50 at once on a loaded 2-core host) is an error the
        # guard rightly takes for an outage, and a happy-path test then sees every write skipped.
        # A stopped or dead server is not a connect timeout (the kernel accepts or refuses).
        client = aioredis.Redis.from_url(url, socket_connect_timeout=2.0, socket_timeout=2.0)
        clients.append(client)
        return client

    yield make
    for client in clients:
        with contextlib.suppress(Exception):
            await client.aclose()


@contextlib.contextmanager
def frozen(server) -> Iterator[None]:
    """The private redis-server stops answering (SIGSTOP) until the block ends (SIGCONT)."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def thaw_later(server, delay_s: float) -> asyncio.TimerHandle:
    return asyncio.get_running_loop().call_later(delay_s, os.kill, server.proc.pid, signal.SIGCONT)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


# -- the happy path, on the shared Redis ------------------------------------------------------


async def test_calls_return_redis_results(redis_url, key_prefix, connect):  # noqa: F811
    client = connect(redis_url)
    g, reasons = guard()
    key = f"{key_prefix}:k"
    assert await g.call(client.set(key, "v")) is True
    assert await g.call(client.get(key)) == b"v"
    assert await g.call(client.get(f"{key_prefix}:missing")) is None  # a real None: no fallback
    assert reasons == []
    assert g.available()


async def test_background_write_lands_after_flush(redis_url, key_prefix, connect):  # noqa: F811
    client = connect(redis_url)
    g, reasons = guard()
    key = f"{key_prefix}:w"
    g.spawn(client.set(key, "written"))  # returns at once: the write runs in the background
    await g.flush()
    assert await client.get(key) == b"written"
    assert reasons == []


async def test_background_writes_run_concurrently_and_all_land(redis_url, key_prefix, connect):  # noqa: F811
    client = connect(redis_url)
    g, reasons = guard()
    for i in range(50):
        g.spawn(client.set(f"{key_prefix}:n{i}", i))
    await g.flush()
    assert reasons == []  # first: a fallback (why the writes did not land) is the better message
    values = await client.mget([f"{key_prefix}:n{i}" for i in range(50)])
    assert values == [str(i).encode() for i in range(50)]


async def test_a_data_error_fails_that_call_alone(redis_url, key_prefix, connect):  # noqa: F811
    """WRONGTYPE on one corrupt key: that call falls back, Redis stays in use for every other key
    (it was taken for an outage: one bad key sent every tenant's limits to the local copy)."""
    client = connect(redis_url)
    g, reasons = guard()
    key = f"{key_prefix}:string"
    await client.set(key, "not a list")
    assert await g.call(client.lpush(key, "x")) is None  # WRONGTYPE: a ResponseError
    assert reasons == ["data_error"]
    assert g.available()
    assert await g.call(client.set(f"{key_prefix}:other", "1")) is True  # the next call goes to Redis


def test_spawn_without_a_running_loop_closes_the_write():
    g, reasons = guard()
    ran = []

    async def write() -> None:
        ran.append(True)

    coro = write()
    g.spawn(coro)  # configuration time: nothing to run it on
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
    assert ran == []
    assert reasons == []


# -- outages, on private redis-servers ------------------------------------------------------


async def test_redis_down_falls_back_and_is_skipped_for_a_while(redis_servers, connect, caplog):  # noqa: F811
    server = redis_servers()
    client = connect(server.url)
    g, reasons = guard(retry_after_s=0.3)
    assert await g.call(client.ping()) is True
    server.kill()
    caplog.set_level(logging.WARNING, logger=LOGGER)

    assert await g.call(client.ping()) is None
    assert reasons == ["error"]
    assert not g.available()

    skipped = client.ping()
    async with asyncio.timeout(0.05):  # no request pays for the outage while Redis is skipped
        assert await g.call(skipped) is None
    assert inspect.getcoroutinestate(skipped) == inspect.CORO_CLOSED  # never sent, never leaked
    assert reasons == ["error", "skipped"]
    assert len(warnings(caplog)) == 1
    assert "Redis error" in warnings(caplog)[0]


async def test_outage_is_logged_once_and_the_recovery_once(redis_servers, connect, caplog):  # noqa: F811
    server = redis_servers()
    client = connect(server.url)
    g, reasons = guard(retry_after_s=0.1)
    assert await g.call(client.ping()) is True
    caplog.set_level(logging.WARNING, logger=LOGGER)
    server.kill()
    for _ in range(3):  # three failed tries, each after the skip window
        assert await g.call(client.ping()) is None
        await asyncio.sleep(0.15)
    assert reasons == ["error", "error", "error"]

    redis_servers(port=server.port)  # Redis is back on the same address
    await asyncio.sleep(0.15)
    assert g.available()
    assert await g.call(client.ping()) is True  # redis-py reconnects on its own
    assert await g.call(client.ping()) is True
    messages = warnings(caplog)
    assert len(messages) == 2
    assert "using the local copy" in messages[0]
    assert messages[1] == "test store: Redis is back"


async def test_a_frozen_redis_times_out_within_the_budget(redis_servers, connect):  # noqa: F811
    server = redis_servers()
    client = connect(server.url)
    g, reasons = guard(budget_s=0.05)
    assert await g.call(client.ping()) is True
    with frozen(server):
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await g.call(client.ping()) is None
        elapsed = loop.time() - started
    assert reasons == ["timeout"]
    assert elapsed < 0.5  # the budget, not redis-py's socket timeout (2 s) or forever
    assert not g.available()


async def test_per_call_budget_overrides_the_default(redis_servers, connect):  # noqa: F811
    server = redis_servers()
    client = connect(server.url)
    g, reasons = guard(budget_s=0.01)
    assert await g.call(client.ping(), budget_s=1.0) is True
    os.kill(server.proc.pid, signal.SIGSTOP)
    thaw_later(server, 0.1)
    assert await g.call(client.ping(), budget_s=1.5) is True  # slow, but within its own budget
    assert reasons == []


async def test_background_writes_get_twenty_times_the_budget(redis_servers, connect):  # noqa: F811
    server = redis_servers()
    client = connect(server.url)
    g, reasons = guard(budget_s=0.02)  # reads: 20 ms; writes: 400 ms
    assert await g.call(client.ping()) is True
    os.kill(server.proc.pid, signal.SIGSTOP)
    thaw_later(server, 0.1)
    g.spawn(client.set("k", "late but fine"))
    await g.flush()
    assert reasons == []
    assert await client.get("k") == b"late but fine"


async def test_background_writes_get_at_least_100_ms(redis_servers, connect):  # noqa: F811
    server = redis_servers()
    client = connect(server.url)
    g, reasons = guard(budget_s=0.001)  # 20 × 1 ms would be 20 ms
    assert await g.call(client.ping(), budget_s=1.0) is True
    os.kill(server.proc.pid, signal.SIGSTOP)
    thaw_later(server, 0.04)
    g.spawn(client.set("k", "v"))
    await g.flush()
    assert reasons == []
    assert await client.get("k") == b"v"


async def test_too_many_pending_writes_are_dropped_and_counted(redis_servers, connect):  # noqa: F811
    server = redis_servers()
    client = connect(server.url)
    g, reasons = guard(budget_s=0.1, max_pending_writes=2)
    assert await g.call(client.ping()) is True
    with frozen(server):
        g.spawn(client.set("a", 1))
        g.spawn(client.set("b", 2))
        dropped = client.set("c", 3)
        g.spawn(dropped)
        assert inspect.getcoroutinestate(dropped) == inspect.CORO_CLOSED
        assert reasons == ["write_dropped"]
        await asyncio.sleep(0)  # let the two writes go out before Redis resumes
    await g.flush()
    assert await client.mget(["a", "b", "c"]) == [b"1", b"2", None]


async def test_writes_while_redis_is_skipped_are_not_attempted(redis_servers, connect):  # noqa: F811
    server = redis_servers()
    client = connect(server.url)
    g, reasons = guard(retry_after_s=5.0)
    server.kill()
    assert await g.call(client.ping()) is None
    write = client.set("k", "v")
    g.spawn(write)
    assert inspect.getcoroutinestate(write) == inspect.CORO_CLOSED
    await g.flush()
    assert reasons == ["error"]  # skipped writes are not counted as dropped by overload


async def test_a_failed_background_write_starts_the_skip_window(redis_servers, connect):  # noqa: F811
    server = redis_servers()
    client = connect(server.url)
    g, reasons = guard(retry_after_s=5.0)
    assert await g.call(client.ping()) is True
    server.kill()
    g.spawn(client.set("k", "v"))
    await g.flush()
    assert reasons == ["error"]
    assert not g.available()  # reads skip Redis too, without paying for a try
    assert await g.call(client.get("k")) is None
    assert reasons == ["error", "skipped"]


async def test_guards_are_independent(redis_servers, connect):  # noqa: F811
    down, up = redis_servers(), redis_servers()
    down_client, up_client = connect(down.url), connect(up.url)
    g_down, down_reasons = guard()
    g_up, up_reasons = guard()
    down.kill()
    assert await g_down.call(down_client.ping()) is None
    key = uuid.uuid4().hex
    assert await g_up.call(up_client.set(key, "x")) is True
    assert (down_reasons, up_reasons) == (["error"], [])
    assert g_up.available() and not g_down.available()
