"""Which endpoints are in the fleet, merged from every source: config file, admin API, discovery.

Each source owns a full list (``apply(source, endpoints)`` replaces that source's
list); the fleet is their union, with the first source to name a URL winning
(``config`` before ``admin`` before discovery). Changes reach the registry as
adds and removes of ``Endpoint`` objects. Removal only takes the endpoint out of
scheduling: requests already sent hold their own reference to it and finish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from gateway.config import EndpointConfig
from gateway.fleet.dp import carry_targets
from gateway.fleet.endpoint import Endpoint, public_url
from gateway.fleet.registry import EndpointRegistry, endpoint_from_config

__all__ = ["ADMIN_SOURCE", "CONFIG_SOURCE", "FleetMembership"]

log = logging.getLogger(__name__)

CONFIG_SOURCE = "config"
ADMIN_SOURCE = "admin"
_PRECEDENCE = {CONFIG_SOURCE: 0, ADMIN_SOURCE: 1}
# A draining endpoint that leaves (a readiness blip, a DNS record missing for a round) comes back
# draining within this long; later, its address may be another replica's.
_DRAIN_MEMORY_S = 900.0


class FleetMembership:
    def __init__(
        self,
        registry: EndpointRegistry,
        on_added: Callable[[list[Endpoint]], None] | None = None,
        on_removed: Callable[[list[Endpoint]], None] | None = None,
        on_replaced: Callable[[list[tuple[Endpoint, Endpoint]]], None] | None = None,
    ) -> None:
        self._registry = registry
        self._sources: dict[str, dict[str, EndpointConfig]] = {}
        self._owner: dict[str, tuple[str, EndpointConfig]] = {}  # url → (source, config in force)
        self.on_added = on_added
        self.on_removed = on_removed
        self.on_replaced = on_replaced  # (previous, successor): same URL, new settings
        self._left_draining: dict[str, float] = {}  # URL → when it left the fleet while draining
        # URL → the endpoint that left the fleet with requests still running on it: back (a config
        # rolled back, a readiness flap), its successor counts them, as one replaced in place does
        self._left_loaded: dict[str, Endpoint] = {}
        self._shadowed: set[str] = set()  # URLs left out as another spelling of a replica (logged once)

    def seed(self, source: str, endpoints: Iterable[EndpointConfig]) -> None:
        """Record what the registry was built with, without touching it."""
        configs = {e.url: e for e in endpoints}
        self._sources[source] = configs
        for url, cfg in configs.items():
            self._owner.setdefault(url, (source, cfg))

    def source_of(self, url: str) -> str | None:
        owner = self._owner.get(url)
        return owner[0] if owner else None

    def holds(self, config: EndpointConfig) -> bool:
        """An endpoint of exactly this config is in the fleet (applying it again builds nothing)."""
        owner = self._owner.get(config.url)
        return owner is not None and owner[1] == config

    def endpoints_of(self, source: str) -> list[EndpointConfig]:
        return list(self._sources.get(source, {}).values())

    def apply(self, source: str, endpoints: Iterable[EndpointConfig]) -> tuple[list[str], list[str]]:
        """Replace ``source``'s list; returns (added URLs, removed URLs).

        Every new ``Endpoint`` is built before anything changes, so a bad entry (an
        unreadable token file) raises ``ConfigError`` and leaves the fleet as it was. An
        endpoint whose URL stays but whose config changed is replaced in place, keeping
        what the gateway knows about it (health, scraped load, drain state).
        """
        sources = {**self._sources, source: {e.url: e for e in endpoints}}
        wanted: dict[str, tuple[str, EndpointConfig]] = {}
        replicas: dict[str, str] = {}  # the URL without user info → the URL that names it first
        for name in sorted(sources, key=lambda s: (_PRECEDENCE.get(s, 2), s)):
            for url, cfg in sources[name].items():
                first = replicas.setdefault(public_url(url).rstrip("/"), url)
                if first == url:
                    wanted.setdefault(url, (name, cfg))
                elif url not in self._shadowed:  # the same replica (config with credentials, say)
                    self._shadowed.add(url)
                    log.warning("%s: %s is %s again; the first source wins", name, public_url(url), first)
        built = {
            url: endpoint_from_config(cfg)
            for url, (_, cfg) in wanted.items()
            if url not in self._owner or self._owner[url][1] != cfg
        }

        self._sources = sources
        self._shadowed &= {url for urls in sources.values() for url in urls}  # logged again if back
        removed: list[Endpoint] = []
        added: list[Endpoint] = []
        replaced: list[tuple[Endpoint, Endpoint]] = []
        now = time.monotonic()
        self._left_draining = {u: t for u, t in self._left_draining.items() if now - t < _DRAIN_MEMORY_S}
        self._left_loaded = {u: e for u, e in self._left_loaded.items() if _loaded(e)}
        for url in [u for u in self._owner if u not in wanted]:
            endpoint = self._registry.remove(url, rebuild=False)
            if endpoint is not None:
                removed.append(endpoint)
                if endpoint.draining:  # an admin drain outlives a blip of its source
                    self._left_draining[url] = now
                if _loaded(endpoint):
                    self._left_loaded[url] = endpoint
            del self._owner[url]
        for url, endpoint in built.items():
            previous = self._registry.get(url) if url in self._owner else None
            if previous is not None:
                _carry_over(previous, endpoint)
                replaced.append((previous, endpoint))
            else:
                endpoint.draining = self._left_draining.pop(url, None) is not None
                if (left := self._left_loaded.pop(url, None)) is not None:
                    # Requests still run on it: it was serving a moment ago. Its health and models
                    # come back with it (a replica not yet probed has no learned ranks to count
                    # them on, and serves nothing until its models are read again).
                    endpoint.healthy = endpoint.inherited_health = left.healthy  # until it is probed
                    endpoint.discovered_models, endpoint.adapters = left.discovered_models, left.adapters
                    if left.rank_targets and not endpoint.rank_targets:
                        carry_targets(left, endpoint)
                    _carry_load(left, endpoint)
                added.append(endpoint)
            self._registry.add(endpoint, rebuild=False)
        self._owner.update(wanted)  # the winning source too (one that names it alike may take over)
        if built or removed:
            self._registry.rebuild()
        if replaced and self.on_replaced is not None:
            self.on_replaced(replaced)
        if added or removed:
            log.info(
                "fleet change from %s: +%s -%s",
                source,
                [e.name for e in added],
                [e.name for e in removed],
            )
            if removed and self.on_removed is not None:
                self.on_removed(removed)
            if added and self.on_added is not None:
                self.on_added(added)
        return [e.url for e in added], [e.url for e in removed]


def _carry_over(previous: Endpoint, endpoint: Endpoint) -> None:
    """Same replica, new settings: what was observed about it stays true."""
    endpoint.healthy, endpoint.inherited_health = previous.healthy, previous.inherited_health
    endpoint.consecutive_failures = previous.consecutive_failures
    endpoint.consecutive_successes = previous.consecutive_successes
    endpoint.discovered_models = previous.discovered_models
    endpoint.adapters = previous.adapters
    endpoint.metrics = previous.metrics
    endpoint.draining = previous.draining
    endpoint.ejected = previous.ejected
    carry_targets(previous, endpoint)
    _carry_load(previous, endpoint)


def _loaded(endpoint: Endpoint) -> bool:
    return endpoint.in_flight > 0 or any(target.in_flight > 0 for target in endpoint.rank_targets)


def _carry_load(previous: Endpoint, endpoint: Endpoint) -> None:
    """The replica's running requests, and its per-rank ones, count on its successor."""
    _move_load(previous, endpoint)
    for old in previous.rank_targets:
        for new in endpoint.rank_targets:
            if new.dp_rank == old.dp_rank:
                _move_load(old, new)


def _move_load(previous: Endpoint, endpoint: Endpoint) -> None:
    """Requests still running on ``previous`` count on its successor, and end there."""
    endpoint.in_flight = previous.in_flight
    endpoint.in_flight_tokens = previous.in_flight_tokens
    endpoint.pending_prefill_tokens = previous.pending_prefill_tokens
    endpoint.adapters_in_flight = previous.adapters_in_flight
    endpoint.learned_capacity = previous.learned_capacity
    previous.replaced_by = endpoint
