"""DNS discovery against a real DNS server over UDP on 127.0.0.1, whose records the tests change."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.config import ConfigError, DnsDiscoveryConfig, EndpointConfig
from gateway.fleet.discovery.dns import DnsSource, parse_nameserver
from tests.fleet.discovery.conftest import Recorder
from tests.fleet.discovery.dnsserver import FakeDnsServer, running_dns


@pytest.fixture
async def dns_server() -> AsyncIterator[FakeDnsServer]:
    async with running_dns() as server:
        yield server


def source_for(server: FakeDnsServer, **settings: Any) -> DnsSource:
    settings = {"interval_s": 0.05, "nameserver": server.nameserver, **settings}
    return DnsSource(DnsDiscoveryConfig(**settings), lifetime_s=0.2, backoff_max_s=0.2)


async def test_a_records_follow_the_zone(dns_server: FakeDnsServer, recorder: Recorder, run_source) -> None:
    dns_server.set("vllm.test", "A", "10.0.0.1", "10.0.0.2")
    source = source_for(
        dns_server, name="vllm.test", record="A", port=8000, role="decode", engine="sglang", models=["m"]
    )
    assert source.name == "dns:vllm.test"
    run_source(source, recorder)
    endpoints = await recorder.wait_urls({"http://10.0.0.1:8000", "http://10.0.0.2:8000"})
    assert {(e.role, e.engine, tuple(e.models)) for e in endpoints} == {("decode", "sglang", ("m",))}

    dns_server.set("vllm.test", "A", "10.0.0.2", "10.0.0.3")  # one replaced
    await recorder.wait_urls({"http://10.0.0.2:8000", "http://10.0.0.3:8000"})
    dns_server.set("vllm.test", "A", "10.0.0.3")  # one removed
    await recorder.wait_urls({"http://10.0.0.3:8000"})

    calls, asked = len(recorder.calls), dns_server.asked("vllm.test")
    await asyncio.sleep(0.3)
    assert dns_server.asked("vllm.test") >= asked + 3, "it keeps re-resolving"
    assert len(recorder.calls) == calls, "an unchanged answer is not applied again"
    assert [name for name, _ in recorder.calls] == ["dns:vllm.test"] * calls


async def test_aaaa_and_dual_stack_urls(dns_server: FakeDnsServer, recorder: Recorder, run_source) -> None:
    dns_server.set("v6.test", "AAAA", "fd00::1", "fd00:0:0:0::2")
    dns_server.set("v6.test", "A", "10.0.0.9")
    run_source(source_for(dns_server, name="v6.test", record="AAAA", port=8000), recorder)
    await recorder.wait_urls({"http://[fd00::1]:8000", "http://[fd00::2]:8000"})

    both = Recorder()
    run_source(source_for(dns_server, name="v6.test", record="A+AAAA", port=9000, scheme="https"), both)
    await both.wait_urls({"https://10.0.0.9:9000", "https://[fd00::1]:9000", "https://[fd00::2]:9000"})
    dns_server.set("v6.test", "AAAA")  # only the A record left: no AAAA answer is not an error
    await both.wait_urls({"https://10.0.0.9:9000"})


async def test_srv_records_give_each_target_its_port(
    dns_server: FakeDnsServer, recorder: Recorder, run_source
) -> None:
    srv = ("0 50 8000 pod-a.vllm.test.", "0 50 8001 pod-b.vllm.test.", "1 10 8000 pod-a.vllm.test.")
    dns_server.set("_http._tcp.vllm.test", "SRV", *srv)  # the last one: the same endpoint again
    dns_server.set("pod-a.vllm.test", "A", "10.0.0.1")
    dns_server.set("pod-b.vllm.test", "A", "10.0.0.2")
    dns_server.set("pod-b.vllm.test", "AAAA", "fd00::2")
    run_source(source_for(dns_server, name="_http._tcp.vllm.test", record="SRV"), recorder)
    endpoints = await recorder.wait_urls(
        {"http://10.0.0.1:8000", "http://10.0.0.2:8001", "http://[fd00::2]:8001"}
    )
    assert len(endpoints) == 3, "one endpoint per address and port"
    assert {e.url: e.labels for e in endpoints}["http://10.0.0.2:8001"] == {"host": "pod-b.vllm.test"}
    await asyncio.sleep(0.15)
    assert dns_server.asked("pod-a.vllm.test") == 0, "the additional section was used, not a new query"

    dns_server.glue = False  # now the targets must be resolved one by one
    dns_server.set("_http._tcp.vllm.test", "SRV", "0 50 8000 pod-a.vllm.test.", "0 50 9001 pod-b.vllm.test.")
    await recorder.wait_urls({"http://10.0.0.1:8000", "http://10.0.0.2:9001", "http://[fd00::2]:9001"})
    assert dns_server.asked("pod-a.vllm.test") >= 2  # A and AAAA

    dns_server.set("pod-a.vllm.test", "A")  # a target that no longer exists is dropped, the rest stay
    await recorder.wait_urls({"http://10.0.0.2:9001", "http://[fd00::2]:9001"})


async def test_nxdomain_and_empty_answers_are_an_authoritative_empty_set(
    dns_server: FakeDnsServer, recorder: Recorder, run_source
) -> None:
    run_source(source_for(dns_server, name="later.test", record="A", port=8000), recorder)
    await recorder.wait_for(lambda eps: eps == [], what="NXDOMAIN → the first apply, empty")
    dns_server.set("later.test", "A", "10.0.0.1")
    await recorder.wait_urls({"http://10.0.0.1:8000"})
    dns_server.set("later.test", "A")  # the name is gone: NXDOMAIN
    await recorder.wait_for(lambda eps: eps == [], what="NXDOMAIN → empty")
    dns_server.set("later.test", "A", "10.0.0.1")
    await recorder.wait_urls({"http://10.0.0.1:8000"})
    dns_server.set("later.test", "TXT", '"still here"')
    dns_server.set("later.test", "A")  # the name exists, but has no A record: NOERROR, no answer
    await recorder.wait_for(lambda eps: eps == [], what="no answer → empty")
    assert [len(eps) for _, eps in recorder.calls] == [0, 1, 0, 1, 0]


async def test_failures_keep_the_last_set(dns_server: FakeDnsServer, recorder: Recorder, run_source) -> None:
    dns_server.set("vllm.test", "A", "10.0.0.1", "10.0.0.2")
    task = run_source(source_for(dns_server, name="vllm.test", record="A", port=8000), recorder)
    good = await recorder.wait_urls({"http://10.0.0.1:8000", "http://10.0.0.2:8000"})

    for mode in ("servfail", "silent"):  # SERVFAIL; a server that never answers (timeouts)
        dns_server.mode = mode
        asked = dns_server.asked("vllm.test")
        dns_server.set("vllm.test", "A")  # would be NXDOMAIN, if the server could say so
        await dns_server.wait_asked("vllm.test", asked + 3)  # it keeps trying
        assert recorder.latest == good and len(recorder.calls) == 1, mode
        dns_server.set("vllm.test", "A", "10.0.0.1", "10.0.0.2")

    port = dns_server.port
    dns_server.stop()  # the nameserver is down: queries are refused
    await asyncio.sleep(0.5)
    assert recorder.latest == good and len(recorder.calls) == 1
    assert not task.done()

    dns_server.mode = "ok"
    dns_server.set("vllm.test", "A", "10.0.0.2")
    await dns_server.start(port)  # back on the same port: the next resolution applies the change
    await recorder.wait_urls({"http://10.0.0.2:8000"})


def test_nameserver_forms() -> None:
    assert parse_nameserver("10.96.0.10") == ("10.96.0.10", 53)
    assert parse_nameserver("127.0.0.1:5353") == ("127.0.0.1", 5353)
    assert parse_nameserver("::1") == ("::1", 53)
    assert parse_nameserver("[fd00::a]:5353") == ("fd00::a", 5353)
    for bad in ("kube-dns.kube-system:53", "10.0.0.1:0", "10.0.0.1:dns", "[::1]:70000"):
        with pytest.raises(ConfigError, match="nameserver"):
            parse_nameserver(bad)
    with pytest.raises(ConfigError, match="nameserver"):
        DnsSource(DnsDiscoveryConfig(name="x.test", port=80, nameserver="dns.example:53"))


async def test_a_failing_apply_is_retried_and_never_stops_the_source(
    dns_server: FakeDnsServer, recorder: Recorder, run_source
) -> None:
    attempts: list[list[str]] = []

    def flaky_apply(source: str, endpoints: list[EndpointConfig]) -> None:
        attempts.append([e.url for e in endpoints])
        if len(attempts) == 1:
            raise RuntimeError("the reconciler had a bad moment")
        recorder(source, endpoints)

    dns_server.set("vllm.test", "A", "10.0.0.1")
    run_source(source_for(dns_server, name="vllm.test", record="A", port=8000), flaky_apply)
    await recorder.wait_urls({"http://10.0.0.1:8000"})
    assert attempts[:2] == [["http://10.0.0.1:8000"]] * 2  # the same set, offered again
