"""Scrapes each endpoint's ``/metrics`` on an interval and keeps ``Endpoint.metrics`` current.

Metrics older than ``stale_after_s`` are marked stale; scorers then fall back to the
gateway's own in-flight counts instead of trusting old numbers. Admission may also ask for
one endpoint's scrape at once (:meth:`MetricsPoller.scrape_soon`, a burst from idle), at
most once per ``burst_min_interval_s`` per endpoint and never two at a time.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence

import aiohttp

from gateway.config import ScrapeConfig
from gateway.fleet.bodies import read_bounded
from gateway.fleet.dp import update_rank_loads
from gateway.fleet.endpoint import Endpoint
from gateway.fleet.interval import Interval
from gateway.fleet.registry import EndpointRegistry
from gateway.fleet.scraper import ScrapedPage, parse_page
from gateway.ops.metrics import GatewayMetrics

__all__ = ["MetricsPoller"]

log = logging.getLogger(__name__)

_BURST_LOOKS = 6  # scrapes at most per burst-triggered look (admission waits burst_settle_s at most)
_BURST_LOOK_GAP_S = 0.01
_PARSE_OFF_LOOP_CHARS = 1 << 18  # 4x an engine's ~60 KB page: a bigger one is parsed in a thread


def _known_charset(charset: str | None) -> str:
    """The page's charset if Python knows it, else UTF-8 (what every engine sends)."""
    try:
        return codecs.lookup(charset).name if charset else "utf-8"
    except LookupError:
        return "utf-8"


def _unseen(target: Endpoint, sent: int) -> bool:
    """Its engine neither queues nor runs yet what the gateway had sent it (and still has in flight)."""
    m = target.metrics
    if m.running is None or m.waiting is None or m.waiting > 0:
        return False  # not reported, or queueing: that teaches the capacity
    return m.running + m.waiting < min(sent, target.in_flight)


class MetricsPoller:
    def __init__(
        self,
        registry: EndpointRegistry,
        session: aiohttp.ClientSession,
        config: ScrapeConfig,
        metrics: GatewayMetrics,
        on_restart: Callable[[Endpoint], None] | None = None,
        on_scraped: Callable[[Endpoint], None] | None = None,
        on_stale: Callable[[Endpoint], None] | None = None,
    ) -> None:
        self._registry = registry
        self._session = session
        self._config = config
        self._metrics = metrics
        self._on_restart = on_restart
        self._on_scraped = on_scraped
        self._on_stale = on_stale  # its metrics just went stale: what was read from them is unknown now
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self._interval = Interval(config.interval_s)
        self._last_marker: dict[str, float] = {}
        self._soon: dict[str, asyncio.Task[None]] = {}  # url → its burst-triggered scrape in progress
        self._soon_at: dict[str, float] = {}  # url → when its last one started
        # url → the scrape time its last burst-triggered look failed after: none again until a newer one
        self._soon_failed: dict[str, float] = {}

    def reconfigure(self, config: ScrapeConfig) -> None:
        """A reloaded ``scrape`` section: interval, timeout and staleness from the next round
        (``enabled`` is restart-only: it decides whether this poller runs at all)."""
        self._config = config
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self._interval.set(config.interval_s)

    async def run(self, *, pause_first: bool = False) -> None:
        async for _ in self._interval.rounds(pause_first=pause_first):
            await self.scrape_all()

    def scrape_soon(self, endpoint: Endpoint) -> None:
        """Scrape ``endpoint`` (a rank target: its URL's endpoint) now, unless one is running or recent."""
        endpoint = endpoint.owner
        url = endpoint.url
        now = time.monotonic()
        if url in self._soon or now - self._soon_at.get(url, -math.inf) < self._config.burst_min_interval_s:
            return
        if endpoint not in self._registry or self._soon_failed.get(url) == endpoint.metrics.scraped_at:
            return
        self._soon_at[url] = now
        task = asyncio.get_running_loop().create_task(
            self._scrape_until_seen(endpoint), name=f"scrape-soon {endpoint.name}"
        )
        self._soon[url] = task
        task.add_done_callback(functools.partial(self._soon_done, url))
        self._metrics.burst_scrapes.labels(endpoint.name).inc()

    async def _scrape_until_seen(self, endpoint: Endpoint) -> None:
        """Scrape until the engine's counts hold what the gateway had sent when it asked.

        Requests of a burst are counted as sent before their connections are open, and the
        scrape travels on a warm connection of its own: a first look often finds the engine
        idle although many requests are on their way, and says nothing about its capacity.
        So look again (a few ms apart, a few times at most) until running + waiting covers
        them — or the engine queues, which is what teaches the capacity."""
        for look in range(_BURST_LOOKS):
            # Data parallel: the requests are counted on the rank targets (the replica's stay 0).
            targets = endpoint.rank_targets or (endpoint,)
            sent = [target.in_flight for target in targets]
            scraped_at = endpoint.metrics.scraped_at
            await self._scrape(endpoint)
            if endpoint.metrics.scraped_at == scraped_at:  # failed: looking again costs a timeout each
                self._soon_failed[endpoint.url] = scraped_at
                return
            if not any(_unseen(target, n) for target, n in zip(targets, sent, strict=True)):
                return
            if look + 1 < _BURST_LOOKS:
                await asyncio.sleep(_BURST_LOOK_GAP_S)

    def _soon_done(self, url: str, task: asyncio.Task[None]) -> None:
        if self._soon.get(url) is task:
            del self._soon[url]
        if not task.cancelled() and task.exception() is not None:  # _scrape handles what it expects
            log.error("burst-triggered scrape of %s failed", url, exc_info=task.exception())

    def scraping_soon(self, endpoints: Sequence[Endpoint]) -> list[asyncio.Task[None]]:
        """The burst-triggered scrapes in progress for any of ``endpoints`` (admission waits for them)."""
        soon = self._soon
        if not soon:
            return []
        return [task for e in endpoints if (task := soon.get(e.owner.url)) is not None]

    def close(self) -> None:
        """Cancel burst-triggered scrapes still running (app shutdown)."""
        for task in list(self._soon.values()):
            task.cancel()

    async def scrape_all(self) -> None:
        endpoints = list(self._registry)
        # One endpoint's unforeseen failure must not cost the round (the others' staleness below).
        outcomes = await asyncio.gather(*(self._scrape(e) for e in endpoints), return_exceptions=True)
        for endpoint, outcome in zip(endpoints, outcomes, strict=True):
            if isinstance(outcome, Exception):
                log.warning("scrape of %s failed unexpectedly: %r", endpoint.name, outcome)
        urls = {e.url for e in endpoints}
        for url in self._last_marker.keys() - urls:  # removed endpoints
            del self._last_marker[url]
        for url in self._soon_at.keys() - urls:
            del self._soon_at[url]
        for url in self._soon_failed.keys() - urls:
            del self._soon_failed[url]
        now = time.monotonic()
        for endpoint in endpoints:
            m = endpoint.metrics
            was_stale, m.stale = m.stale, m.scraped_at == 0 or now - m.scraped_at > self._config.stale_after_s
            for target in endpoint.rank_targets:
                target.metrics.stale = m.stale
            if endpoint in self._registry:  # removed while scraped: its series are gone, keep them so
                self._metrics.endpoint_metrics_stale.labels(endpoint.name).set(1 if m.stale else 0)
                if m.stale and not was_stale and self._on_stale is not None:
                    self._on_stale(endpoint)

    async def _scrape(self, endpoint: Endpoint) -> None:
        try:
            async with self._session.get(
                endpoint.base_url + "/metrics",
                timeout=self._timeout,
                headers={"authorization": endpoint.auth_header} if endpoint.auth_header else None,
                ssl=endpoint.ssl_context or True,
            ) as resp:
                if resp.status != 200:
                    raise ValueError(f"status {resp.status}")
                text = (await read_bounded(resp)).decode(_known_charset(resp.charset))
            if len(text) > _PARSE_OFF_LOOP_CHARS:  # a page far past an engine's ~60 KB: off the loop
                page = await asyncio.to_thread(parse_page, text, endpoint.engine)
            else:
                page = parse_page(text, endpoint.engine)  # once: the ranks' loads are read from it too
            load = page.load
        except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as exc:
            if endpoint in self._registry:
                self._metrics.scrape_errors.labels(endpoint.name).inc()
            log.debug("scrape of %s failed: %s", endpoint.name, exc)
            return
        m = endpoint.metrics
        m.waiting, m.running, m.kv_usage = load.waiting, load.running, load.kv_usage
        m.lora = load.lora
        if load.block_size is not None:
            m.block_size, m.num_blocks = load.block_size, load.num_blocks
        m.scraped_at = time.monotonic()
        m.in_flight_at_scrape = endpoint.in_flight
        m.stale = False
        if endpoint not in self._registry:
            return
        self._metrics.endpoint_waiting.labels(endpoint.name).set(load.waiting or 0)
        self._metrics.endpoint_running.labels(endpoint.name).set(load.running or 0)
        self._metrics.endpoint_kv_usage.labels(endpoint.name).set(load.kv_usage or 0)
        self._detect_restart(endpoint, load.restart_marker)
        try:  # one endpoint's odd page is its scrape error, never the whole round's
            if self._on_scraped:
                self._on_scraped(endpoint)
            self._scraped_ranks(endpoint, page)
        except Exception:
            self._metrics.scrape_errors.labels(endpoint.name).inc()
            log.exception("scrape of %s: its load could not be applied", endpoint.name)

    def _scraped_ranks(self, endpoint: Endpoint, page: ScrapedPage) -> None:
        """Data parallel (fleet/dp.py): each rank's load and gauges; dropped ranks forgotten."""
        changed, dropped = update_rank_loads(endpoint, page)
        if changed:
            log.warning("endpoint %s: now %d data-parallel ranks", endpoint.name, len(endpoint.rank_targets))
            self._registry.rebuild()
        if dropped:  # their index state, series and exact-index entries go, as every dropped rank's
            self._registry.on_dropped_targets(dropped)
        for target in endpoint.rank_targets:
            self._metrics.endpoint_waiting.labels(target.name).set(target.metrics.waiting or 0)
            self._metrics.endpoint_running.labels(target.name).set(target.metrics.running or 0)
            self._metrics.endpoint_kv_usage.labels(target.name).set(target.metrics.kv_usage or 0)
            if self._on_scraped:
                self._on_scraped(target)

    def _detect_restart(self, endpoint: Endpoint, marker: float | None) -> None:
        if marker is None:
            return
        previous = self._last_marker.get(endpoint.url)
        self._last_marker[endpoint.url] = marker
        if previous is not None and marker < previous:
            log.warning("endpoint %s restarted (its counters went backwards)", endpoint.name)
            if self._on_restart:
                self._on_restart(endpoint)
