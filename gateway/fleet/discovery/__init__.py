"""Endpoint discovery: Kubernetes pods (list + watch) and DNS (A/AAAA/SRV).

Each source reports its full endpoint list through ``apply``; :mod:`gateway.fleet.membership`
merges the sources. The shared pieces are in :mod:`~gateway.fleet.discovery.source`.
"""

from __future__ import annotations

from gateway.config import DiscoveryConfig
from gateway.fleet.discovery.dns import DnsSource
from gateway.fleet.discovery.kubernetes import KubernetesSource
from gateway.fleet.discovery.source import ApplyEndpoints, Backoff, DiscoverySource, Publisher

__all__ = ["ApplyEndpoints", "Backoff", "DiscoverySource", "Publisher", "build_sources"]


def build_sources(config: DiscoveryConfig) -> list[DiscoverySource]:
    """One source per configured authority. Raises ``ConfigError`` for what cannot work at all."""
    sources: list[DiscoverySource] = []
    if config.kubernetes is not None:
        sources.append(KubernetesSource(config.kubernetes))
    sources.extend(DnsSource(dns) for dns in config.dns)
    return sources
