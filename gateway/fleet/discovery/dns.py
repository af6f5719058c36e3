"""Endpoints from a DNS name, re-resolved every ``interval_s``: A / AAAA / A+AAAA with the configured
port, or SRV (each record's target and port; the targets' addresses from the additional section when
the server sent them — Kubernetes headless services and Consul do — else resolved).

DNS answers split cleanly into "authoritative none" and "could not ask": NXDOMAIN and an empty
answer mean there really are no endpoints (applied as an empty list), while a timeout, SERVFAIL or a
refused query keeps the last set and retries with capped back-off. dnspython's async resolver is used
so a slow nameserver never blocks the event loop (``getaddrinfo`` would need a thread, and cannot
read SRV records).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver
from pydantic import ValidationError

from gateway.config import ConfigError, DnsDiscoveryConfig, EndpointConfig
from gateway.fleet.discovery.source import ApplyEndpoints, Backoff, Publisher, no_op

__all__ = ["DnsSource", "parse_nameserver"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_TARGET_LOOKUPS = 16  # SRV targets without glue looked up at once
_ADDRESS_TYPES = {
    "A": (dns.rdatatype.A,),
    "AAAA": (dns.rdatatype.AAAA,),
    "A+AAAA": (dns.rdatatype.A, dns.rdatatype.AAAA),
    "SRV": (dns.rdatatype.A, dns.rdatatype.AAAA),  # for the SRV targets
}


def parse_nameserver(text: str) -> tuple[str, int]:
    """``10.0.0.10``, ``10.0.0.10:5353``, ``::1`` or ``[::1]:5353`` → (address, port)."""
    host, port = text, "53"
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") or port
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        ipaddress.ip_address(host)
        number = int(port)
        if not 1 <= number <= 65535:
            raise ValueError(port)
    except ValueError:
        raise ConfigError(
            f"discovery.dns.nameserver: {text!r} is not an IP address with an optional port"
        ) from None
    return host, number


async def _all(coros: Iterable[Awaitable[T]]) -> list[T]:
    """Run concurrently; on the first failure cancel the rest and raise that failure itself."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(coro) for coro in coros]  # type: ignore[arg-type]
    except ExceptionGroup as failures:
        raise failures.exceptions[0] from None
    return [task.result() for task in tasks]


class DnsSource:
    """One DNS name → its endpoints. See the module docstring."""

    def __init__(
        self,
        config: DnsDiscoveryConfig,
        *,
        lifetime_s: float | None = None,
        backoff_max_s: float = 30.0,
    ) -> None:
        self._config = config
        self.name = f"dns:{config.name}"
        self._nameserver = parse_nameserver(config.nameserver) if config.nameserver else None
        # One resolution may take this long in all (retries included); never longer than 5 s.
        self._lifetime = lifetime_s if lifetime_s is not None else min(5.0, max(1.0, config.interval_s))
        self._backoff = Backoff(min(config.interval_s, 1.0), max(config.interval_s, backoff_max_s))
        self._resolver: dns.asyncresolver.Resolver | None = None
        self.on_failure: Callable[[], None] = no_op

    async def run(self, apply: ApplyEndpoints) -> None:
        publisher = Publisher(self.name, apply)
        while True:
            try:
                endpoints = await self.resolve()
            except Exception as exc:
                log.warning(
                    "%s: %s; keeping %d endpoints", self.name, _describe(exc), len(publisher.last or [])
                )
                self.on_failure()
                delay = self._backoff.next()
            else:
                publisher.publish(endpoints)
                self._backoff.reset()
                delay = self._config.interval_s
            await asyncio.sleep(delay)

    async def resolve(self) -> list[EndpointConfig]:
        """The name's endpoints now; ``[]`` when DNS says there are none; raises when DNS cannot say."""
        resolver = self._get_resolver()
        if self._config.record == "SRV":
            targets = await self._srv(resolver)
        else:
            port = self._config.port
            assert port is not None  # the config requires it for address records
            addresses = await self._addresses(resolver, self._config.name, search=True)
            targets = [(address, port, None) for address in addresses]
        endpoints = []
        for address, port, host in targets:
            endpoint = self._endpoint(address, port, host)
            if endpoint is not None:
                endpoints.append(endpoint)
        return endpoints

    # ---- queries ------------------------------------------------------------------------
    async def _query(
        self, resolver: dns.asyncresolver.Resolver, name: str | dns.name.Name, rdtype: int, search: bool
    ) -> dns.resolver.Answer | None:
        """The answer, or ``None`` for NXDOMAIN / no records of this type (both authoritative)."""
        try:
            answer = await resolver.resolve(name, rdtype, raise_on_no_answer=False, search=search)
        except dns.resolver.NXDOMAIN:
            return None
        return answer if answer.rrset is not None else None

    async def _addresses(
        self, resolver: dns.asyncresolver.Resolver, name: str | dns.name.Name, search: bool
    ) -> list[str]:
        rdtypes = _ADDRESS_TYPES[self._config.record]
        answers = await _all(self._query(resolver, name, rdtype, search) for rdtype in rdtypes)
        return [rdata.address for answer in answers if answer is not None for rdata in answer.rrset or ()]

    async def _srv(self, resolver: dns.asyncresolver.Resolver) -> list[tuple[str, int, str]]:
        answer = await self._query(resolver, self._config.name, dns.rdatatype.SRV, search=True)
        if answer is None:
            return []
        glue: dict[dns.name.Name, list[str]] = {}
        for rrset in answer.response.additional:
            if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                glue.setdefault(rrset.name, []).extend(rdata.address for rdata in rrset)
        records = [r for r in answer.rrset or () if r.target != dns.name.root]  # "." = no service
        missing = list({r.target for r in records if r.target not in glue})
        lookups = asyncio.Semaphore(_TARGET_LOOKUPS)  # two UDP sockets each: 600 targets at once ran out

        async def addresses(target: dns.name.Name) -> list[str]:
            async with lookups:
                return await self._addresses(resolver, target, search=False)

        resolved = await _all(addresses(target) for target in missing)
        glue.update(zip(missing, resolved, strict=True))
        targets = []
        for record in records:
            host = record.target.to_text(omit_final_dot=True)
            if not glue[record.target]:
                log.debug("%s: SRV target %s has no addresses", self.name, host)
            targets.extend((address, int(record.port), host) for address in glue[record.target])
        return targets

    def _get_resolver(self) -> dns.asyncresolver.Resolver:
        if self._resolver is None:
            resolver = dns.asyncresolver.Resolver(configure=self._nameserver is None)
            if self._nameserver is not None:
                resolver.nameservers = [dns.nameserver.Do53Nameserver(*self._nameserver)]
            resolver.timeout = self._lifetime
            resolver.lifetime = self._lifetime
            self._resolver = resolver
        return self._resolver

    def _endpoint(self, address: str, port: int, host: str | None) -> EndpointConfig | None:
        ip = ipaddress.ip_address(address)
        netloc = f"[{ip.compressed}]:{port}" if ip.version == 6 else f"{ip.compressed}:{port}"
        try:
            return EndpointConfig(
                url=f"{self._config.scheme}://{netloc}",
                models=list(self._config.models),
                role=self._config.role,
                engine=self._config.engine,
                labels={"host": host} if host else {},
            )
        except ValidationError as exc:
            log.warning("%s: %s:%d is not a valid endpoint: %s", self.name, address, port, exc)
            return None


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
