"""A tiny authoritative DNS server over UDP on 127.0.0.1, answering from records the test edits.

Names without any record answer NXDOMAIN; a known name without records of the asked type answers
NOERROR with an empty answer. SRV answers carry the targets' A/AAAA records in the additional
section when ``glue`` is on (as Kubernetes' CoreDNS does for headless services).
``mode``: "ok", "servfail" (rcode SERVFAIL) or "silent" (never answers: the client times out).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rrset

__all__ = ["FakeDnsServer", "running_dns"]


class FakeDnsServer(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.records: dict[tuple[dns.name.Name, int], list[str]] = {}
        self.glue = True
        self.mode = "ok"
        self.queries: list[tuple[str, str]] = []  # (name, type) in arrival order
        self.port = 0
        self._asked = asyncio.Event()
        self._transport: asyncio.DatagramTransport | None = None

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def discovery(self, port: int, name: str = "llm.test", interval_s: float = 0.1) -> dict[str, Any]:
        """The gateway's ``discovery`` section: one A-record source asking this server."""
        source = {"name": name, "record": "A", "port": port, "nameserver": self.nameserver}
        return {"dns": [{**source, "interval_s": interval_s}]}

    def set(self, name: str, rdtype: str, *rdatas: str) -> None:
        """Replace ``name``'s records of ``rdtype``; none given removes them."""
        key = (dns.name.from_text(name), dns.rdatatype.from_text(rdtype))
        if rdatas:
            self.records[key] = list(rdatas)
        else:
            self.records.pop(key, None)

    def asked(self, name: str) -> int:
        wanted = dns.name.from_text(name)
        return sum(1 for qname, _ in self.queries if dns.name.from_text(qname) == wanted)

    async def wait_asked(self, name: str, count: int, within_s: float = 3.0) -> None:
        """Until ``name`` was asked ``count`` times in all."""
        async with asyncio.timeout(within_s):
            while self.asked(name) < count:
                self._asked.clear()
                await self._asked.wait()

    async def start(self, port: int = 0) -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: self, local_addr=("127.0.0.1", port))
        self._transport = transport
        self.port = transport.get_extra_info("sockname")[1]

    def stop(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    # ---- the protocol ------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self._transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        query = dns.message.from_wire(data)
        question = query.question[0]
        self.queries.append((question.name.to_text(), dns.rdatatype.to_text(question.rdtype)))
        self._asked.set()
        if self.mode == "silent" or self._transport is None:
            return
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        if self.mode == "servfail":
            response.set_rcode(dns.rcode.SERVFAIL)
        elif not any(name == question.name for name, _ in self.records):
            response.set_rcode(dns.rcode.NXDOMAIN)
        else:
            response.answer.extend(self._rrsets(question.name, question.rdtype))
            if question.rdtype == dns.rdatatype.SRV and self.glue:
                for rdata in self.records.get((question.name, dns.rdatatype.SRV), []):
                    target = dns.name.from_text(rdata.split()[-1])
                    for family in (dns.rdatatype.A, dns.rdatatype.AAAA):
                        response.additional.extend(self._rrsets(target, family))
        self._transport.sendto(response.to_wire(), addr)

    def _rrsets(self, name: dns.name.Name, rdtype: int) -> list[dns.rrset.RRset]:
        rdatas = self.records.get((name, rdtype))
        return [dns.rrset.from_text_list(name, 30, "IN", rdtype, rdatas)] if rdatas else []


@contextlib.asynccontextmanager
async def running_dns() -> AsyncIterator[FakeDnsServer]:
    server = FakeDnsServer()
    await server.start()
    try:
        yield server
    finally:
        server.stop()
