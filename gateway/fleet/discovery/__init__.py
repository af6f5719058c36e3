"""Endpoint discovery: Kubernetes pods (list + watch) and DNS (A/AAAA/SRV).

Each source reports its full endpoint list through ``apply``; :mod:`gateway.fleet.membership`
merges the sources. The shared pieces are in :mod:`~gateway.fleet.discovery.source`.
"""

from __future__ import annotations

import logging

from gateway.config import DiscoveryConfig, EndpointConfig
from gateway.fleet.discovery.dns import DnsSource
from gateway.fleet.discovery.kubernetes import KubernetesSource
from gateway.fleet.discovery.source import ApplyEndpoints, Backoff, DiscoverySource, Publisher
from gateway.fleet.networks import EndpointNetworks

__all__ = ["ApplyEndpoints", "Backoff", "DiscoverySource", "NetworkFiltered", "Publisher", "build_sources"]

log = logging.getLogger(__name__)


class NetworkFiltered:
    """A source whose endpoints outside the allowed networks never reach the fleet (logged once)."""

    def __init__(self, source: DiscoverySource, networks: EndpointNetworks) -> None:
        self.name = source.name
        self.source = source
        self.on_failure = source.on_failure
        self._networks = networks
        self._refused: set[str] = set()

    async def run(self, apply: ApplyEndpoints) -> None:
        def filtered(name: str, endpoints: list[EndpointConfig]) -> None:
            kept = []
            for endpoint in endpoints:
                refusal = self._networks.refusal_now(endpoint.url)
                if refusal is None:
                    kept.append(endpoint)
                elif endpoint.url not in self._refused:
                    self._refused.add(endpoint.url)
                    log.warning("%s: endpoint %s refused: %s", name, endpoint.url, refusal)
            apply(name, kept)

        self.source.on_failure = self.on_failure
        await self.source.run(filtered)


def build_sources(config: DiscoveryConfig, redis_urls: tuple[str, ...] = ()) -> list[DiscoverySource]:
    """One source per configured authority. Raises ``ConfigError`` for what cannot work at all.

    Every source is filtered by ``discovery.allowed_networks`` (and the link-local rule):
    whoever can label a pod or publish a DNS record must not steer traffic anywhere.
    """
    sources: list[DiscoverySource] = []
    if config.kubernetes is not None:
        sources.append(KubernetesSource(config.kubernetes))
    sources.extend(DnsSource(dns) for dns in config.dns)
    networks = EndpointNetworks.from_config(config, redis_urls)
    return [NetworkFiltered(source, networks) for source in sources]
