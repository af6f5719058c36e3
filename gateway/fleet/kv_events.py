"""Subscribers to the engines' KV-event streams (vLLM's ZMQ publisher), one per endpoint.

Each endpoint's stream is found with ``GET /kv_event_sources`` (``tcp://*:PORT`` becomes
the replica's host) or named in its config; a ZMQ SUB socket connects to it (the
publisher binds). Frames are decoded in batches of up to ``_DRAIN`` messages between
yields, so a burst never holds the event loop, and fed to a :class:`KVEventSink`.

Sequence numbers keep the state exact: a gap is filled from the replay endpoint (a
DEALER sends ``[b"", start_seq]``, the ROUTER answers each buffered message as
``[b"", topic, seq, payload]`` — vLLM 0.32; older ones leave the topic out — then seq
-1); a hole in a replay (vLLM's ROUTER drops past its send queue) is asked for again; what
the replay cannot give back any more, or a stream without replay, drops the endpoint's
state (never keep a block whose removal may have been missed). Every
(re)connection drops the state and replays from 0: a restarted engine starts at seq 0
with an empty cache, an old one resends its buffer. A disconnected stream, or one whose
batches arrive later than ``stale_after_s`` after publishing, is not live: the sink
answers for it from the approximate index. Malformed frames and unknown event types are
logged (once per endpoint at warning level) and counted, never fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.config.kv_events import ExactPrefixConfig
from gateway.fleet.endpoint import Endpoint
from gateway.fleet.kv_replay import Replay, fetch_replay
from gateway.fleet.kv_sources import KVEventSource, discover_source, source_from
from gateway.fleet.kv_wire import DecodeError, KVEventSink, UnknownEvent, decode_ranked_batch, decode_seq
from gateway.fleet.registry import EndpointRegistry
from gateway.fleet.zmq_context import OwnedContext
from gateway.ops.kv_metrics import KVEventMetrics
from gateway.ops.tasks import supervise
from gateway.ops.time_slice import TimeSlice

__all__ = ["KVEventSource", "KVEventSubscriber", "discover_source", "source_from"]

log = logging.getLogger(__name__)

_DRAIN = 256  # messages decoded per wake-up before yielding to the loop
_SLICE_S = 0.005  # and at most this long: a batch can hold thousands of blocks (a replay: 10k batches)
_POLL_MS = 250
_HEARTBEAT_IVL_MS = 1000  # a ZMTP ping this often on a stream …
_HEARTBEAT_TIMEOUT_MS = 3000  # … and a peer silent this long after one is gone
# vLLM's replay ROUTER drops what its send queue (1,000 messages) cannot hold: a hole is asked
# for again from where it starts (each fetch gets at least that far past it: ~10 for a full
# 10,000-batch buffer), this many fetches at most before the state starts over after it
_REPLAY_FETCHES = 32
# a batch this far behind the next one wanted is a new publisher (or the one before was a
# bogus jump), not one already applied: vLLM's replay buffer holds 10,000 batches
_RESYNC_SPAN = 100_000


class KVEventSubscriber:
    """Keeps one supervised stream task per endpoint of the registry."""

    def __init__(
        self,
        registry: EndpointRegistry,
        session: aiohttp.ClientSession,
        sink: KVEventSink,
        metrics: KVEventMetrics,
        config: ExactPrefixConfig,
        *,
        on_crash: Callable[[str], None] | None = None,
        reconcile_s: float = 1.0,
    ) -> None:
        self._registry = registry
        self._session = session
        self.sink = sink
        self.metrics = metrics
        self.config = config
        self._on_crash = on_crash
        self._reconcile_s = reconcile_s
        self._tasks: dict[str, tuple[Endpoint, asyncio.Task[None]]] = {}  # by target name
        self._ctx: zmq.asyncio.Context | None = None

    async def run(self) -> None:
        self._ctx = OwnedContext()
        try:
            while True:
                self.reconcile()
                await asyncio.sleep(self._reconcile_s)
        finally:
            tasks = [task for _, task in self._tasks.values()]
            for task in tasks:
                task.cancel()
            try:
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:  # a second cancellation must not leave the context open (see _close_context)
                self._tasks.clear()
                self._close_context()

    def _close_context(self) -> None:
        """Close every socket and the context now, whatever the streams' tasks are doing
        (:class:`~gateway.fleet.zmq_context.OwnedContext` says why it matters)."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.destroy(linger=0)

    def reconcile(self) -> None:
        # One stream per routing target: a replica, or each data-parallel rank of one (fleet/dp.py).
        current = {e.name: e for e in self._registry.targets()}
        for key, (endpoint, task) in list(self._tasks.items()):
            if current.get(key) is not endpoint:
                task.cancel()  # its stream's last words (not live) must not bring it back: follows()
                del self._tasks[key]
                self.sink.clear(endpoint.name, "removed")
                self.metrics.forget(endpoint.name)
        for key, endpoint in current.items():
            if key not in self._tasks:
                name = f"kv-events-{endpoint.name}"
                task = asyncio.get_running_loop().create_task(
                    supervise(name, lambda e=endpoint: self._follow(e), on_crash=self._on_crash), name=name
                )
                self._tasks[key] = (endpoint, task)

    def follows(self, name: str, task: asyncio.Task[Any] | None) -> bool:
        """Whether ``task`` is still the one following ``name`` (not removed or replaced since)."""
        followed = self._tasks.get(name)
        return followed is not None and followed[1] is task

    async def _follow(self, endpoint: Endpoint) -> None:
        while True:
            if endpoint.owner.kv_events is not None:
                host = urlsplit(endpoint.base_url).hostname or ""
                source = source_from(endpoint.owner.kv_events, host, endpoint.dp_rank)
            elif self.config.discover:
                source = await discover_source(self._session, endpoint, self.config.replay_timeout_s)
            else:
                source = None
            opened = False
            if source is not None and self._ctx is not None:
                opened = await _Stream(self, endpoint.name, source, self._ctx, endpoint.dp_rank).run()
            else:
                self.sink.set_live(endpoint.name, False)
            # an address ZeroMQ refuses is asked for again at the discovery pace, not in a tight loop
            await asyncio.sleep(0.1 if opened else self.config.rediscover_s)


class _Stream:
    """One connection to one publisher; returns after being disconnected for ``rediscover_s``."""

    def __init__(
        self,
        owner: KVEventSubscriber,
        name: str,
        source: KVEventSource,
        ctx: zmq.asyncio.Context,
        rank: int | None = None,
    ):
        self.owner, self.name, self.source, self.ctx = owner, name, source, ctx
        self.rank = rank  # a DP rank target's: batches of another rank are refused
        self.sink, self.metrics, self.config = owner.sink, owner.metrics, owner.config
        self.expected: int | None = None  # next sequence number wanted; None: not synced
        self.connected = False
        self.fresh = True
        self._warned = False
        self._task = asyncio.current_task()

    async def run(self) -> bool:
        """Follow the stream; False at once if no socket could be opened for it."""
        try:
            sub = self.ctx.socket(zmq.SUB)
        except zmq.ZMQError as exc:  # the context's socket limit: this stream waits, others run
            log.warning("kv events: %s: no socket for %s: %s", self.name, self.source.endpoint, exc)
            return False
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        # A SUB socket sends nothing once subscribed: a publisher whose host vanished without a
        # FIN (power loss, a partition, a dropped NAT entry) left the stream "live" for ever, its
        # blocks routed on and the engine that came back at that address never followed. ZMTP
        # pings are answered by the peer's ZeroMQ I/O thread, not its Python: 3 s of silence
        # after one is a dead peer, and the monitor below sees the disconnect.
        sub.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        # connected means the ZeroMQ handshake is done: a port that accepts TCP and never speaks
        # ZMTP (a wrong port, a proxy before its upstream is up) must not count as a live stream
        try:
            monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        except zmq.ZMQError as exc:
            log.warning("kv events: %s: no monitor for %s: %s", self.name, self.source.endpoint, exc)
            sub.close(0)
            return False
        try:
            sub.connect(self.source.endpoint)
        except zmq.ZMQError as exc:  # an address ZeroMQ refuses: no stream, and no socket left open
            log.warning("kv events: %s cannot connect to %s: %s", self.name, self.source.endpoint, exc)
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
            return False
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        down_since = time.monotonic()
        log.info("kv events: %s subscribed to %s", self.name, self.source.endpoint)
        try:
            while True:
                ready = dict(await poller.poll(_POLL_MS))
                if monitor in ready:
                    await self._monitor(monitor, sub)
                if sub in ready:
                    await self._drain(sub)
                if self.connected:
                    down_since = time.monotonic()
                elif time.monotonic() - down_since > self.config.rediscover_s:
                    return True  # the publisher may have moved: ask /kv_event_sources again
        finally:
            self._set_live(False)
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    # -- connection -------------------------------------------------------------------------
    async def _monitor(self, monitor: zmq.asyncio.Socket, sub: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
                # A new connection may be a new engine (seq from 0, empty cache): start over
                # from whatever the replay buffer still holds.
                self.sink.clear(self.name, "reconnect")
                self.expected = 0
                await self._replay(0, lost_reason=None)
                self._set_live(True)
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self._set_live(False)
                # what the old connection still has queued would follow the next one's replay and
                # look like a gap (a restarted engine counts from 0 again): it is dropped here
                await self._discard(sub)
                log.warning(
                    "kv events: %s publisher disconnected; approximate index answers for it", self.name
                )

    def _set_live(self, live: bool) -> None:
        if not self.owner.follows(self.name, self._task):
            return  # removed from the fleet (or replaced): its entry and series are gone for good
        live = live and self.connected and self.fresh and self.expected is not None
        self.sink.set_live(self.name, live)
        self.metrics.live.labels(self.name).set(1 if live else 0)

    # -- messages ---------------------------------------------------------------------------
    async def _discard(self, sub: zmq.asyncio.Socket) -> None:
        time_slice = TimeSlice(_SLICE_S)
        for _ in range(1_000_000):  # bounded by the socket's receive limit (100,000)
            try:
                await sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            await time_slice.pause()

    async def _drain(self, sub: zmq.asyncio.Socket) -> None:
        time_slice = TimeSlice(_SLICE_S)
        for _ in range(_DRAIN):
            if time_slice.spent():
                break
            try:
                frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                self._malformed(f"{len(frames)} frames, not 3")
                continue
            try:
                seq = decode_seq(frames[1])
            except DecodeError as exc:
                self._malformed(str(exc))
                continue
            await self._on_message(seq, frames[2])
        await asyncio.sleep(0)  # a burst: let requests run between drains

    async def _on_message(self, seq: int, payload: bytes) -> None:
        try:
            batch = self._decode(payload)
        except DecodeError as exc:
            self._malformed(str(exc))
            return
        if self.expected is None:
            return  # not synced yet: the replay on connect covers it
        if seq < self.expected - _RESYNC_SPAN:
            self._reset("sequence went back", seq)  # a new publisher, or the last jump was bogus
        elif seq < self.expected:
            return  # already applied (replayed)
        if seq > self.expected:
            self.metrics.replays.labels(self.name, "gap").inc()
            await self._replay(self.expected, lost_reason="gap", until=seq)
            if seq < self.expected:
                return
        self._apply(seq, batch)

    def _decode(self, payload: bytes) -> tuple[float, list[Any], list[str]]:
        """A batch; one of another DP rank than this stream's is kept in sequence but emptied."""
        ts, events, errors, rank = decode_ranked_batch(payload)
        if self.rank is not None and rank is not None and rank != self.rank:
            return ts, [], [*errors, f"a batch of data_parallel_rank {rank} on rank {self.rank}'s stream"]
        return ts, events, errors

    def _apply(self, seq: int, batch: tuple[float, list[Any], list[str]], *, replayed: bool = False) -> None:
        ts, events, errors = batch
        for error in errors:
            self._malformed(error)
        known = []
        for event in events:
            if isinstance(event, UnknownEvent):
                self.metrics.count_unknown(self.name, event.type[:64])
                self._warn_once(f"unknown event type {event.type[:64]!r}")
            else:
                known.append(event)
        self.sink.apply(self.name, known, ts)
        self.metrics.applied.labels(self.name).inc(len(known))
        self.expected = seq + 1
        if replayed:
            return  # old by nature: a replay brings the state up to date, it says nothing of lag
        lag = max(0.0, time.time() - ts)
        self.metrics.lag.labels(self.name).set(lag)
        fresh = lag <= self.config.stale_after_s
        if fresh != self.fresh:
            self.fresh = fresh
            self._set_live(True)

    async def _replay(self, start: int, *, lost_reason: str | None, until: int | None = None) -> None:
        """Apply the buffered messages from ``start``; what cannot be had drops the state.

        On connect (no ``lost_reason``) the buffer starts where it starts. A hole after the first
        message is asked for again (vLLM's ROUTER drops what its send queue cannot hold, and a
        removal lost there would leave an evicted block indexed); one still missing after
        ``_REPLAY_FETCHES`` fetches starts the state over after it. A replay that went quiet
        without its end marker may have lost its tail as well: it is asked for again too."""
        first_may_jump = lost_reason is None
        for tries_left in reversed(range(_REPLAY_FETCHES)):
            replay = await self._fetch_replay(start)
            if replay is None:
                if until is not None:  # a gap nobody can fill: start over from here
                    self._reset(lost_reason or "gap", until)
                return
            reason = lost_reason or "replay hole"
            last = tries_left == 0
            if await self._apply_replayed(replay.batches, first_may_jump, reason, stop_at_hole=not last):
                self.metrics.replays.labels(self.name, "hole").inc()
            elif replay.ended or last:
                break
            assert self.expected is not None
            start, first_may_jump = self.expected, False
        if until is not None and self.expected is not None and self.expected < until:
            self._reset(lost_reason or "gap", until)
        self.metrics.replays.labels(self.name, "ok").inc()

    async def _apply_replayed(
        self, replayed: list[tuple[int, bytes]], first_may_jump: bool, reason: str, *, stop_at_hole: bool
    ) -> bool:
        """Apply a replay in order, yielding to the loop every ``_SLICE_S``; True if it stopped at
        a hole to ask for it again. A first message past the one wanted is where the buffer now
        starts: accepted on connect, else the state starts over there."""
        time_slice = TimeSlice(_SLICE_S)
        first = True
        for seq, payload in replayed:
            assert self.expected is not None
            if seq < self.expected:
                continue
            if seq > self.expected:
                if first and not first_may_jump:
                    self._reset(reason, seq)  # the buffer no longer reaches back far enough
                elif not first and stop_at_hole:
                    return True
                elif not first:
                    self._reset(reason, seq)
            first = False
            try:
                batch = self._decode(payload)
            except DecodeError as exc:  # it will not decode on a second fetch either: lost
                self._malformed(str(exc))
                self._reset(reason, seq + 1)
                continue
            self._apply(seq, batch, replayed=True)
            await time_slice.pause()
        return False

    def _reset(self, reason: str, seq: int) -> None:
        self.sink.clear(self.name, reason)  # the sink counts the reset if it held anything
        self.expected = seq
        log.warning(
            "kv events: %s lost events (%s); its exact state starts over at seq %d", self.name, reason, seq
        )

    async def _fetch_replay(self, start: int) -> Replay | None:
        address = self.source.replay_endpoint
        if address is None:
            return None
        try:
            wait_s = self.config.replay_timeout_s
            replay = await fetch_replay(self.ctx, address, start, wait_s, self._malformed)
        except (TimeoutError, DecodeError, zmq.ZMQError) as exc:
            self.metrics.replays.labels(self.name, "failed").inc()
            log.warning("kv events: %s: replay from %s failed: %s", self.name, address, exc or "timeout")
            return None
        if not replay.ended:
            self.metrics.replays.labels(self.name, "unterminated").inc()
        return replay

    def _malformed(self, why: str) -> None:
        self.metrics.decode_errors.labels(self.name).inc()
        self._warn_once(f"malformed KV-event frame: {why}")

    def _warn_once(self, message: str) -> None:
        if self._warned:
            log.debug("kv events: %s: %s", self.name, message)
        else:
            self._warned = True
            log.warning("kv events: %s: %s (further ones at debug level)", self.name, message)
