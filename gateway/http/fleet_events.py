"""What the gateway does when endpoints join, leave, are replaced in place or change health.

Wired to :class:`~gateway.fleet.membership.FleetMembership` and the health state by
:mod:`gateway.http.app`. Leaving means forgetting: the prefix index's blocks, the breaker,
every ``endpoint=`` series, the latency model and the connection pool, or a removed
replica's state would be kept (and exported) for the life of the process.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.fleet.dp import set_ranks
from gateway.fleet.endpoint import Endpoint
from gateway.fleet.health import HealthChecker
from gateway.http.state import GatewayState
from gateway.proxy.upstream import UpstreamClient

__all__ = ["FleetEvents"]

log = logging.getLogger(__name__)


class FleetEvents:
    def __init__(self, state: GatewayState, client: UpstreamClient, health: HealthChecker) -> None:
        self._state = state
        self._client = client
        self._health = health
        self._forget_tasks: set[asyncio.Task[None]] = set()
        self._probe_tasks: set[asyncio.Task[None]] = set()
        self._misconfigured: set[str] = set()  # configured rank targets their server refused (logged)

    def forget(self, endpoint: Endpoint, *, then_series: bool = False) -> None:
        """Its cached blocks are gone (a restart, down): drop them from the prefix index;
        ``then_series``: it left for good, its series and state go once that is done (not
        before: the purge would re-create an exact-index gauge the removal had dropped)."""
        task = asyncio.get_running_loop().create_task(self._forget(endpoint, then_series))
        self._forget_tasks.add(task)
        task.add_done_callback(self._forget_tasks.discard)

    async def _forget(self, endpoint: Endpoint, then_series: bool) -> None:
        try:
            for each in (endpoint, *endpoint.rank_targets):  # a data-parallel replica: every rank's state
                await self._state.prefix.forget(each)
        finally:
            if then_series and self._gone(endpoint):  # not back meanwhile: else the series are its new self's
                self.forget_series(endpoint)

    def _gone(self, endpoint: Endpoint) -> bool:
        registry = self._state.registry
        if endpoint.dp_rank is None:
            return registry.get(endpoint.url) is None
        return all(t.name != endpoint.name for t in registry.targets())

    def on_dropped_targets(self, targets: list[Endpoint]) -> None:
        """Data-parallel ranks that are gone (their replica down, or configured with fewer)."""
        for target in targets:
            self.forget(target, then_series=True)

    def on_rank_refused(self, target: Endpoint) -> None:
        """Its server refused the rank: restarted with fewer, between two scrapes. The learned
        ranks go (the server routes as one target, vLLM picks the rank) and a scrape now
        learns the new ones. Configured ranks stay: the config is wrong, and is logged."""
        replica = target.owner
        if replica.data_parallel_size is not None:
            if target.name not in self._misconfigured:  # once, not once per request
                self._misconfigured.add(target.name)
                log.warning("endpoint %s refused %s: check its data_parallel_size", replica.name, target.name)
            return
        if target not in replica.rank_targets:  # another request's refusal got here first
            return
        log.warning("endpoint %s refused %s: learning its ranks again", replica.name, target.name)
        dropped = set_ranks(replica, [])
        self._state.registry.rebuild()
        self.on_dropped_targets(dropped)
        if self._state.poller is not None:
            self._state.poller.scrape_soon(replica)

    def on_removed(self, endpoints: list[Endpoint]) -> None:
        state = self._state
        for endpoint in endpoints:
            state.breakers.forget(endpoint.url)
            self.forget_series(endpoint)  # at once: a scrape must not find them (and again after the purge)
            self.forget(endpoint, then_series=True)
            self._client.remove(endpoint.url)  # idle connections close now, busy ones when done

    def forget_series(self, endpoint: Endpoint) -> None:
        """Its ``endpoint=`` series and latency model (exported forever otherwise)."""
        state = self._state
        for each in (endpoint, *endpoint.rank_targets):
            state.metrics.forget_endpoint(each.name)
            state.prefix.drop(each.name)
        if state.plugin_context.latency is not None:
            state.plugin_context.latency.forget(endpoint.name)

    def after_request(self, endpoint: Endpoint) -> None:
        """A request ended. Sent to an endpoint removed since, its outcome re-created the series
        that the removal forgot: they go again once the last such request is done (not if the
        URL is back in the fleet meanwhile: the series are then the live endpoint's)."""
        registry = self._state.registry
        if registry.get(endpoint.url) is not None:
            # In the fleet: the common case. A data-parallel rank dropped while this ran on it
            # (its replica down, or fewer ranks) re-created its series just the same.
            if endpoint.dp_rank is not None and (rank := endpoint.latest()) not in registry:
                if rank.in_flight <= 0 and self._gone(rank):
                    self.forget_series(rank)
            return
        owner = endpoint.owner.latest()  # replaced in place before it left: the counts moved there
        if all(each.in_flight <= 0 for each in (owner, *owner.rank_targets)):
            self.forget_series(owner)

    def on_replaced(self, pairs: list[tuple[Endpoint, Endpoint]]) -> None:
        """Same URL, new settings: new connections use them (a rotated CA, a new token)."""
        for previous, _ in pairs:
            self._client.remove(previous.url)  # idle connections close now, busy ones when done

    def on_added(self, endpoints: list[Endpoint]) -> None:
        task = asyncio.get_running_loop().create_task(self._health.check(endpoints))
        self._probe_tasks.add(task)
        task.add_done_callback(self._probe_tasks.discard)

    def on_health_change(self, endpoint: Endpoint, healthy: bool) -> None:
        if not healthy:
            self.forget(endpoint)
            self._state.breakers.abort_waits(endpoint, "ejected")  # re-send what still waits on it

    async def close(self) -> None:
        for task in self._probe_tasks:  # a new replica's first probe can take the whole health
            task.cancel()  # timeout: a stop does not wait for it
        await asyncio.gather(*self._forget_tasks, *self._probe_tasks, return_exceptions=True)
