"""``GET /kv_event_sources`` answering garbage: it must be logged and ignored, never crash a task."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os

import pytest

from tests.support.harness import metric_value

from .helpers import EXACT, SourcesUpstream, chat, metrics_text


@pytest.fixture
def start_sources(stack: contextlib.AsyncExitStack):
    async def start() -> SourcesUpstream:
        up = SourcesUpstream(("tiny",))
        await up.start()
        stack.push_async_callback(up.stop)
        return up

    return start


GOOD = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events"}

GARBAGE = {
    # a DP-rank map whose key is a Unicode digit ("²".isdigit() is True, int("²") raises)
    "superscript_rank_key": {"\u00b2": {**GOOD, "endpoint": "tcp://*:5557"}},
    # a port that is no number: ZMQ refuses the address at connect()
    "port_not_a_number": {**GOOD, "endpoint": "tcp://*:abc"},
    "empty_port": {**GOOD, "endpoint": "tcp://*:"},
}


@pytest.mark.parametrize("case", sorted(GARBAGE))
async def test_garbage_kv_event_sources_never_crash_the_stream_task(start_sources, start_gateway, http, case):
    up = await start_sources()
    up.kv_sources = GARBAGE[case]
    gw = await start_gateway([up.url], prefix=EXACT)
    await asyncio.sleep(2.5)
    status, body = await chat(http, gw.url, "hello " * 5, model="tiny")
    assert status == 200, body
    text = await metrics_text(http, gw.url)
    restarts = metric_value(text, "llm_gateway_background_task_restarts_total", task=f"kv-events-{up.name}")
    assert not restarts, f"{case}: the KV-event task crashed {restarts} times on a bad /kv_event_sources"


def _eventfds() -> int:
    gc.collect()
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += "eventfd" in os.readlink(f"/proc/self/fd/{fd}")
    return count


@pytest.mark.parametrize("endpoint", ["tcp://*:abc", "tcp://*:1"])
async def test_a_refused_stream_address_leaks_no_file_descriptors(
    start_sources, start_gateway, http, endpoint
):
    """Each failed connect() must close the SUB socket and its monitor (ZMQ mailboxes: eventfds).
    ``tcp://*:1`` is the control: a valid address nobody listens on (the stream retries it)."""
    up = await start_sources()
    up.kv_sources = {**GOOD, "endpoint": endpoint}
    gw = await start_gateway([up.url], prefix=EXACT)
    await asyncio.sleep(1.0)
    before = _eventfds()
    await asyncio.sleep(8.0)
    after = _eventfds()
    text = await metrics_text(http, gw.url)
    restarts = metric_value(text, "llm_gateway_background_task_restarts_total", task=f"kv-events-{up.name}")
    assert after - before <= 2, f"{after - before} fds more after {restarts} stream attempts"
