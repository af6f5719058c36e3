"""Which addresses endpoints added at run time (admin API, discovery) may point at.

The config file is the operator's own word; the admin API and discovery are not: an
admin key or a pod label is enough to make the gateway open connections, with the
endpoint's credentials and every client's prompt, to whatever URL they name. So those
URLs must lie in ``discovery.allowed_networks`` when it is set, and link-local addresses
(169.254.169.254 is the cloud metadata service on every major cloud) are refused unless
``discovery.allow_link_local`` says otherwise. Ports of the gateway's own Redis (and
6379) are refused too: a model server never listens there, an SSRF probe does.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from gateway.config import DiscoveryConfig
from gateway.redis_client import redis_ports

# What inet_aton (and so getaddrinfo) reads as an IPv4 address besides the dotted quad:
# one to four parts, each decimal, octal (leading 0) or hexadecimal (0x).
_INET_ATON = re.compile(r"(?:0[xX][0-9a-fA-F]*|[0-9]+)(?:\.(?:0[xX][0-9a-fA-F]*|[0-9]+)){0,3}\.?")

__all__ = ["EndpointNetworks"]

_IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_REDIS_PORT = 6379


class EndpointNetworks:
    def __init__(
        self,
        allowed: Iterable[str] = (),
        *,
        allow_link_local: bool = False,
        denied_ports: Iterable[int] = (),
    ) -> None:
        self._allowed = [ipaddress.ip_network(cidr, strict=False) for cidr in allowed]
        self._allow_link_local = allow_link_local
        self._denied_ports = frozenset(denied_ports) | {_REDIS_PORT}

    @classmethod
    def from_config(cls, config: DiscoveryConfig, redis_urls: Iterable[str] = ()) -> EndpointNetworks:
        ports: set[int] = set()
        for url in redis_urls:
            ports |= redis_ports(url)  # a cluster's seed nodes too
        return cls(config.allowed_networks, allow_link_local=config.allow_link_local, denied_ports=ports)

    def _address_refusal(self, address: _IPAddress) -> str | None:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if address.is_link_local and not self._allow_link_local:
            return f"{address} is link-local (metadata services live there); not allowed"
        if self._allowed and not any(address in network for network in self._allowed):
            return f"{address} is outside discovery.allowed_networks"
        return None

    def _port_refusal(self, url: str) -> str | None:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if port in self._denied_ports:
            return f"port {port} is a Redis port, not a model server's"
        return None

    def refusal_now(self, url: str) -> str | None:
        """Why ``url`` may not join, without resolving names (discovery: hosts are addresses).

        A host name cannot be checked against an allow-list without a lookup, so with one
        set it is refused; without one it is accepted.
        """
        refusal = self._port_refusal(url)
        if refusal is not None:
            return refusal
        host = urlsplit(url).hostname or ""
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            if _INET_ATON.fullmatch(host):  # '2852039166', '0xa9fea9fe', '169.254.43518': what
                return f"{host!r} is an address in a form only the C resolver reads"  # it reads as IPv4
            return (
                "a host name cannot be checked against discovery.allowed_networks" if self._allowed else None
            )
        return self._address_refusal(address)

    async def refusal(self, url: str) -> str | None:
        """Why ``url`` may not join; host names are resolved and every address must pass."""
        refusal = self._port_refusal(url)
        if refusal is not None:
            return refusal
        parts = urlsplit(url)
        host = parts.hostname or ""
        try:
            addresses: list[_IPAddress] = [ipaddress.ip_address(host)]
        except ValueError:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, parts.port or 80, type=socket.SOCK_STREAM
                )
            except OSError:
                return f"host {host!r} does not resolve"
            addresses = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
        for address in addresses:
            refusal = self._address_refusal(address)
            if refusal is not None:
                return refusal
        return None
