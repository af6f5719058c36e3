"""The KV-event subscriber against publishers that misbehave the way real ones can.

A real pyzmq PUB socket and a replay ROUTER answering as vLLM 0.32's does, in front of the
gateway's own subscriber and exact index. Each case was found by an adversarial review
(2026-12-05) and failed before its fix: replay holes kept evicted blocks, a replay held the
event loop, a bare TCP port counted as a live stream, a restarted publisher lost to the old
one's backlog, a jumped sequence number froze the stream, removed endpoints came back, a
refused address warned ten times a second, and ~340 streams exhausted ZeroMQ's sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from gateway.config.kv_events import ExactPrefixConfig, KVEventSourceConfig
from gateway.fleet.endpoint import Endpoint
from gateway.fleet.kv_events import KVEventSubscriber
from gateway.fleet.registry import EndpointRegistry
from gateway.ops.kv_metrics import KVEventMetrics
from gateway.prefix.exact import ExactIndex
from loadtest.harness.kv_replayer import ThreadedPublisher
from loadtest.kv_replay_stall import counter_total

B = 16  # block size


def stored(hashes: list[int], tokens_seed: int = 0) -> dict:
    tokens = [(tokens_seed + i) % 30_000 for i in range(B * len(hashes))]
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": B,
        "medium": "GPU",
    }


def removed(hashes: list[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def batch(events: list[dict]) -> bytes:
    return msgspec.msgpack.encode([time.time(), events, None])


class Publisher(ThreadedPublisher):
    def endpoint(self, port: int) -> Endpoint:  # type: ignore[override]
        """A replica at ``port`` (never asked: the stream is named in its config) publishing here."""
        e = Endpoint(f"http://127.0.0.1:{port}", healthy=True)
        e.kv_events = KVEventSourceConfig(endpoint=super().endpoint, replay_endpoint=self.replay_endpoint)
        return e


class Fleet:
    def __init__(self, endpoints: Iterable[Endpoint], **config) -> None:
        self.registry = EndpointRegistry(list(endpoints))
        self.metrics = KVEventMetrics(CollectorRegistry())
        self.index = ExactIndex(self.metrics)
        self.crashes: list[str] = []
        self.subscriber = KVEventSubscriber(
            self.registry,
            None,  # type: ignore[arg-type]  # no discovery: every endpoint names its stream
            self.index,
            self.metrics,
            ExactPrefixConfig(discover=False, **config),
            on_crash=self.crashes.append,
            reconcile_s=0.2,
        )

    def counted(self, counter, **labels: str) -> float:
        return counter_total(counter, **labels)


@contextlib.asynccontextmanager
async def following(fleet: Fleet) -> AsyncIterator[Fleet]:
    task = asyncio.create_task(fleet.subscriber.run())
    try:
        yield fleet
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert not fleet.crashes


@pytest.fixture
def publishers():
    made: list[Publisher] = []

    def make(*ports: int) -> Publisher:
        made.append(Publisher(*ports))
        return made[-1]

    yield make
    for pub in made:
        with contextlib.suppress(zmq.ZMQError):
            pub.close()


async def until(predicate: Callable[[], bool], within_s: float = 10.0) -> None:
    async with asyncio.timeout(within_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


def _churn(steps: int) -> list[bytes]:
    """Each step stores 32 new blocks and removes the previous step's: the engine ends with 32."""
    out = []
    for m in range(steps):
        events = [stored([m * 32 + i + 1 for i in range(32)], tokens_seed=m)]
        if m:
            events.append(removed([(m - 1) * 32 + i + 1 for i in range(32)]))
        out.append(batch(events))
    return out


async def test_a_hole_in_the_replay_is_asked_for_again_not_skipped(publishers) -> None:
    """The first replay leaves out seqs 700 and 1,500 (the ROUTER's full send queue): skipping
    them kept 64 blocks the engine had evicted, on a stream that said it was live."""
    pub = publishers()
    pub.buffer = list(enumerate(_churn(2000)))
    pub.seq = 2000
    pub.drop = lambda request, seq: request == 0 and seq in (700, 1500)
    ep = pub.endpoint(18_201)
    async with following(Fleet([ep])) as fleet:
        await until(lambda: fleet.index.live(ep.name))
        assert fleet.index.size(ep.name) == 32
        # asked again from the first hole, which also brought the second (a loaded host's ROUTER
        # may drop more of 2,000: more fetches then, the same end state)
        assert pub.replays >= 2
        assert fleet.counted(fleet.metrics.replays, outcome="hole") >= 1
        assert fleet.counted(fleet.metrics.resets) == 0


async def test_a_hole_the_replay_never_fills_starts_the_state_over_after_it(publishers) -> None:
    pub = publishers()
    pub.buffer = list(enumerate(_churn(600)))
    pub.seq = 600
    pub.drop = lambda request, seq: seq == 300  # every time
    ep = pub.endpoint(18_202)
    async with following(Fleet([ep])) as fleet:
        await until(lambda: fleet.index.live(ep.name))
        assert fleet.index.size(ep.name) <= 32  # nothing from before the hole is trusted
        assert pub.replays == 2  # asked again from 300, the answer starts at 301: not there any more
        assert fleet.counted(fleet.metrics.resets, reason="replay hole") == 1


async def test_a_replay_whose_holes_never_end_is_fetched_32_times_at_most(publishers) -> None:
    pub = publishers()
    pub.buffer = list(enumerate(_churn(600)))
    pub.seq = 600
    pub.drop = lambda request, seq: seq == 100 + request  # each answer one batch further, then a hole
    ep = pub.endpoint(18_207)
    async with following(Fleet([ep])) as fleet:
        await until(lambda: fleet.index.live(ep.name))
        assert pub.replays == 32
        assert fleet.counted(fleet.metrics.replays, outcome="hole") == 31
        assert fleet.counted(fleet.metrics.resets, reason="replay hole") == 1
        assert fleet.index.size(ep.name) == 32  # the state after the last hole is the engine's


async def test_an_undecodable_batch_in_a_replay_is_lost_once_not_fetched_again(publishers) -> None:
    pub = publishers()
    pub.buffer = list(enumerate(_churn(400)))
    pub.buffer[100] = (100, b"\xc1 not msgpack")
    pub.seq = 400
    ep = pub.endpoint(18_209)
    async with following(Fleet([ep])) as fleet:
        await until(lambda: fleet.index.live(ep.name))
        assert pub.replays == 1  # the same bytes would come again
        assert fleet.counted(fleet.metrics.resets, reason="replay hole") == 1
        assert fleet.counted(fleet.metrics.decode_errors) == 1
        assert fleet.index.size(ep.name) == 32


async def test_a_replay_whose_end_marker_was_dropped_is_applied_after_a_quiet_spell(publishers) -> None:
    """vLLM's ROUTER can drop the seq -1 that ends a replay as well: the replay waited for its
    timeout and was thrown away whole, so the stream went live knowing nothing."""
    pub = publishers()
    pub.buffer = list(enumerate(_churn(500)))
    pub.seq = 500
    pub.drop = lambda request, seq: request == 0 and (seq == -1 or seq >= 300)  # the tail too
    ep = pub.endpoint(18_208)
    async with following(Fleet([ep], replay_timeout_s=0.5)) as fleet:
        await until(lambda: fleet.index.live(ep.name))
        assert fleet.index.size(ep.name) == 32
        assert pub.replays == 2  # the quiet one, then the rest from where it stopped
        assert fleet.counted(fleet.metrics.replays, outcome="unterminated") == 1
        assert fleet.counted(fleet.metrics.resets) == 0


async def test_a_long_replay_lets_the_event_loop_run(publishers) -> None:
    """10,000 batches of 32 blocks were decoded and applied in one go (a ~0.5 s stall per
    endpoint per reconnect): another task now runs many times while they are applied. With the
    default replay_timeout_s (1 s), which used to bound the whole replay (~1 s of it here)."""
    pub = publishers()
    pub.buffer = [(m, batch([stored([m * 32 + i + 1 for i in range(32)], m)])) for m in range(10_000)]
    pub.seq = 10_000
    ep = pub.endpoint(18_203)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    async with following(Fleet([ep])) as fleet:
        await until(lambda: fleet.counted(fleet.metrics.applied) > 0, within_s=20)
        counting = asyncio.create_task(ticker())
        ticks_at_start = ticks
        await until(lambda: fleet.index.live(ep.name), within_s=30)
        counting.cancel()
        assert fleet.index.size(ep.name) == 320_000
        assert ticks - ticks_at_start >= 10


async def test_a_port_that_accepts_tcp_but_speaks_no_zeromq_is_not_a_live_stream() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # holds the connection, answers nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ep = Endpoint("http://127.0.0.1:18204", healthy=True)
    ep.kv_events = KVEventSourceConfig(endpoint=f"tcp://127.0.0.1:{port}")
    try:
        async with following(Fleet([ep])) as fleet:
            await asyncio.sleep(1.5)
            assert not fleet.index.live(ep.name)
    finally:
        server.close()


async def test_a_restarted_publisher_wins_over_the_old_ones_backlog(publishers) -> None:
    pub = publishers()
    ep = pub.endpoint(18_205)
    async with following(Fleet([ep])) as fleet:
        await until(lambda: fleet.index.live(ep.name))
        for i in range(20_000):  # the old engine's burst, still queued when it dies
            pub.send(batch([stored([10_000_000 + i], i)]), keep=False)
        ports = (pub.pub_port, pub.replay_port)
        pub.close()
        new = publishers(*ports)
        await asyncio.sleep(0.5)
        for i in range(200):
            new.send(batch([stored([i + 1], 50_000 + i)]))
        await until(lambda: fleet.index.live(ep.name) and fleet.index.size(ep.name) >= 200)
        await asyncio.sleep(0.3)
        held = list(fleet.index._endpoints[ep.name].by_engine)
        assert sorted(held) == list(range(1, 201))  # the new engine's, none of the old one's


async def test_a_bogus_sequence_jump_does_not_freeze_the_stream(publishers) -> None:
    pub = publishers()
    ep = pub.endpoint(18_206)
    async with following(Fleet([ep])) as fleet:
        await until(lambda: fleet.index.live(ep.name))
        pub.send(batch([stored([1])]))
        pub.send(batch([stored([2], 100)]), seq=1 << 62, keep=False)  # a corrupt or hostile frame
        for i in range(50):
            pub.send(batch([stored([1000 + i], 200 + i)]), seq=2 + i)
        await until(lambda: 1049 in fleet.index._endpoints[ep.name].by_engine)
        assert fleet.index.live(ep.name)
        assert fleet.counted(fleet.metrics.resets, reason="sequence went back") == 1


async def test_removed_endpoints_leave_no_index_entry_and_no_series(publishers) -> None:
    pubs = [publishers() for _ in range(5)]
    eps = [p.endpoint(18_210 + i) for i, p in enumerate(pubs)]
    async with following(Fleet(eps)) as fleet:
        await until(lambda: all(fleet.index.live(e.name) for e in eps))
        for p in pubs:
            p.send(batch([stored([1])]))
        await until(lambda: all(fleet.index.size(e.name) == 1 for e in eps))
        for e in eps:
            fleet.registry.remove(e.url)
        await asyncio.sleep(1.0)
        assert not [e.name for e in eps if fleet.index.known(e.name)]
        names = {e.name for e in eps}
        assert not [labels for labels in fleet.metrics.live._metrics if labels[0] in names]


async def test_an_address_zeromq_refuses_is_retried_at_the_discovery_pace(caplog) -> None:
    ep = Endpoint("http://127.0.0.1:18220", healthy=True)
    ep.kv_events = KVEventSourceConfig(endpoint="tcp://gpu node-1:5557")  # a typo ZeroMQ refuses
    with caplog.at_level(logging.WARNING, logger="gateway.fleet.kv_events"):
        async with following(Fleet([ep], rediscover_s=1.0)) as fleet:
            await asyncio.sleep(2.5)
            assert not fleet.index.live(ep.name)
    refused = [r for r in caplog.records if "cannot connect" in r.getMessage()]
    assert 1 <= len(refused) <= 3  # was one every 0.1 s


async def test_four_hundred_streams_all_come_up(publishers) -> None:
    """48 replicas × 8 data-parallel ranks is 384 streams; libzmq's default 1,023 sockets held ~340."""
    pub = publishers()
    eps = [pub.endpoint(20_000 + i) for i in range(400)]
    async with following(Fleet(eps)) as fleet:
        await until(lambda: all(fleet.index.live(e.name) for e in eps), within_s=30)


class _Blackhole:
    """A TCP relay to a publisher; :meth:`vanish` stops relaying without closing the subscriber's
    side: what a publisher whose host lost power looks like (no FIN, no RST, silence)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self._pipes: list[tuple[asyncio.StreamWriter, list[asyncio.Task]]] = []

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()

        tasks = [asyncio.create_task(pipe(reader, up_writer)), asyncio.create_task(pipe(up_reader, writer))]
        self._pipes.append((up_writer, tasks))

    def vanish(self) -> None:
        for up_writer, tasks in self._pipes:
            for task in tasks:
                task.cancel()
            up_writer.transport.abort()  # the dead host's side; the subscriber's stays open, silent
        self._pipes.clear()

    async def close(self) -> None:
        self.vanish()
        self._server.close()
        await self._server.wait_closed()


async def test_a_publisher_that_vanishes_without_closing_is_noticed_and_its_successor_followed(
    publishers,
) -> None:
    """Found by review (2026-12-05): the subscriber sent nothing after subscribing, so a host that
    died without closing TCP left the stream live for ever with its blocks, and the engine that
    came back at the same address was never followed."""
    first = publishers()
    relay = _Blackhole(first.pub_port)
    port = await relay.start()
    ep = Endpoint("http://127.0.0.1:18_211", healthy=True)
    ep.kv_events = KVEventSourceConfig(endpoint=f"tcp://127.0.0.1:{port}")
    try:
        async with following(Fleet([ep])) as fleet:
            await until(lambda: fleet.index.live(ep.name))
            await asyncio.sleep(0.3)  # the subscription has reached the publisher
            first.send(batch([stored([1, 2, 3])]))
            await until(lambda: fleet.index.size(ep.name) == 3)
            relay.vanish()  # the host is gone: nothing closes
            first.close()
            second = publishers()  # the engine back at the same address, its cache empty
            relay.target = second.pub_port
            began = time.monotonic()
            while fleet.index.size(ep.name) != 1:
                assert time.monotonic() - began < 15, f"still {fleet.index.size(ep.name)} blocks"
                second.send(batch([{"type": "AllBlocksCleared"}, stored([100])]))
                await asyncio.sleep(0.25)
            assert fleet.index.live(ep.name)
    finally:
        await relay.close()


async def test_made_up_event_types_are_counted_in_a_bounded_set_of_series(publishers) -> None:
    """Found by review (2026-12-05): every unknown type a publisher sent became a series for ever
    (3,000 made-up types: /metrics from 24 KB to 647 KB)."""
    pub = publishers()
    ep = pub.endpoint(18_212)
    async with following(Fleet([ep])) as fleet:
        await until(lambda: fleet.index.live(ep.name))
        await asyncio.sleep(0.3)
        for start in range(0, 3_000, 100):
            pub.send(batch([{"type": f"FutureEvent{i:06d}"} for i in range(start, start + 100)]))
        pub.send(batch([stored([1])]))  # known events still apply, after all of them
        await until(lambda: fleet.index.size(ep.name) == 1)
        samples = [
            s
            for metric in fleet.metrics.unknown.collect()
            for s in metric.samples
            if s.name.endswith("_total")
        ]
        assert len(samples) == 17  # 16 types by name, then "other"
        assert sum(s.value for s in samples) == 3_000
        assert next(s.value for s in samples if s.labels["type"] == "other") == 3_000 - 16


def test_the_bound_on_unknown_type_series_is_per_endpoint_not_per_connection() -> None:
    """Review (2026-12-05): the first bound lived on a stream's connection, and every reconnect
    (a publisher gone for ``rediscover_s``) named 16 more."""
    metrics = KVEventMetrics(CollectorRegistry())

    def series(endpoint: str) -> dict[str, float]:
        return {
            s.labels["type"]: s.value
            for m in metrics.unknown.collect()
            for s in m.samples
            if s.name.endswith("_total") and s.labels["endpoint"] == endpoint
        }

    for connection in range(5):
        for i in range(20):
            metrics.count_unknown("e1", f"T{connection}-{i}")
    metrics.count_unknown("e2", "T0-0")
    assert len(series("e1")) == 17 and series("e1")["other"] == 100 - 16
    assert series("e2") == {"T0-0": 1.0}  # another endpoint's own bound
    metrics.forget("e1")  # it left the fleet: its series and its names go
    assert series("e1") == {}
    metrics.count_unknown("e1", "T9-9")
    assert series("e1") == {"T9-9": 1.0}
