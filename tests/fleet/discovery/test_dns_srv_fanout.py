"""An SRV answer without glue must not open one UDP socket per target (twice) all at once.

Found by review (2026-12-05); failed on the code before the fix.
"""

from __future__ import annotations

import resource
from collections.abc import Iterator

import dns.rdtypes.IN.A
import dns.rdtypes.IN.AAAA
import dns.rdtypes.IN.SRV  # noqa: F401
import pytest

from gateway.config import DnsDiscoveryConfig
from gateway.fleet.discovery.dns import DnsSource
from tests.fleet.discovery.dnsserver import running_dns

TARGETS = 600


@pytest.fixture
def nofile_1024() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_srv_targets_without_glue_resolve_under_a_1024_descriptor_limit(nofile_1024) -> None:
    async with running_dns() as dns:
        dns.glue = False  # a resolver that strips the additional section (minimal responses)
        dns.set("_http._tcp.vllm.test.", "SRV", *[f"0 0 8000 pod{i}.vllm.test." for i in range(TARGETS)])
        for i in range(TARGETS):
            dns.set(f"pod{i}.vllm.test.", "A", f"10.0.{i // 256}.{i % 256}")
        source = DnsSource(
            DnsDiscoveryConfig(
                name="_http._tcp.vllm.test", record="SRV", nameserver=dns.nameserver, interval_s=5
            )
        )
        endpoints = await source.resolve()  # raises NoNameservers: "[Errno 24] Too many open files"
        assert len(endpoints) == TARGETS
