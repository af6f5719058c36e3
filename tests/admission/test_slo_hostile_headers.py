"""Hostile x-slo-* header values over real sockets: a 400 in the OpenAI format or a 200, never a 500."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.admission.conftest import body
from tests.support.harness import gateway_metrics, metric_value


async def _raw_post(port: int, header_lines: list[bytes], payload: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 request written byte for byte (aiohttp's client refuses some header bytes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        head += b"".join(line + b"\r\n" for line in header_lines)
        head += b"Content-Length: " + str(len(payload)).encode() + b"\r\nConnection: close\r\n\r\n"
        writer.write(head + payload)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status = int(raw.split(b" ", 2)[1])
    return status, raw.split(b"\r\n\r\n", 1)[1]


BAD = [
    "1e309",  # overflows to inf
    "-1e309",
    "9" * 400,  # a 400-digit integer
    "-0",
    "-0.0",
    "+inf",
    "Infinity",
    "NaN",
    "0x10",
    "1e-400",  # underflows to 0.0
    "1,5",
    "5ms",
    "1 000",
    "3600000.0001",
    "\t",
]
GOOD = ["1", "0.001", "1e-300", " 250 ", "3600000", "+5", "1e3"]


@pytest.mark.parametrize("value", BAD)
async def test_bad_value_is_a_400_naming_the_header(start_upstream, start_gateway, http, value: str) -> None:
    up = await start_upstream()
    gw = await start_gateway([up.url])
    async with http.post(gw.url + "/v1/chat/completions", json=body(), headers={"x-slo-ttft-ms": value}) as r:
        assert r.status == 400, await r.text()
        payload = await r.json()
    assert payload["error"]["param"] == "x-slo-ttft-ms"
    assert up.requests == []


@pytest.mark.parametrize("value", GOOD)
@pytest.mark.parametrize("priority", ["critical", "standard", "sheddable"])
async def test_odd_but_valid_values_are_served(
    start_upstream, start_gateway, http, value: str, priority: str
) -> None:
    up = await start_upstream()
    gw = await start_gateway([up.url], admission={"slo": {"drop_overdue": True}})
    headers = {"x-slo-ttft-ms": value, "x-slo-tpot-ms": value, "x-priority": priority}
    for stream in (False, True):
        async with http.post(gw.url + "/v1/chat/completions", json=body(stream=stream), headers=headers) as r:
            text = await r.text()
            assert r.status == 200, text


@pytest.mark.parametrize(
    "raw_value",
    [
        b"\xff\xfe",
        "١٢٣".encode(),
        "１００".encode(),
        "\u00a0100".encode(),
        b"100\x00",
        "𝟏𝟎𝟎".encode(),
        b"1_000",
    ],
)
async def test_non_ascii_values_are_a_400_not_a_500(start_upstream, start_gateway, raw_value: bytes) -> None:
    """Non-ASCII header bytes: the route's own 400, never a 500 (and never silently read as a number)."""
    up = await start_upstream()
    gw = await start_gateway([up.url])
    port = int(gw.url.rsplit(":", 1)[1])
    status, payload = await _raw_post(port, [b"x-slo-ttft-ms: " + raw_value], json.dumps(body()).encode())
    assert status == 400, (status, payload)


async def test_a_repeated_header_with_one_bad_value_is_not_silently_accepted(
    start_upstream, start_gateway
) -> None:
    """Two x-slo-ttft-ms fields, the second invalid: a 400, as either alone would give (RFC 9110 §5.3:
    a field that is not a list must not be repeated), not the first one's value silently."""
    up = await start_upstream()
    gw = await start_gateway([up.url])
    port = int(gw.url.rsplit(":", 1)[1])
    lines = [b"x-slo-ttft-ms: 100", b"x-slo-ttft-ms: banana"]
    status, payload = await _raw_post(port, lines, json.dumps(body()).encode())
    assert status == 400, (status, payload)


async def test_many_hostile_requests_leave_no_trace_in_the_queue(start_upstream, start_gateway, http) -> None:
    up = await start_upstream()
    gw = await start_gateway([up.url])
    statuses = []
    for value in [*BAD, *GOOD] * 3:
        async with http.post(
            gw.url + "/v1/chat/completions", json=body(), headers={"x-slo-ttft-ms": value}
        ) as r:
            statuses.append(r.status)
    assert set(statuses) <= {200, 400}
    text = await gateway_metrics(http, gw)
    assert (metric_value(text, "llm_gateway_admission_queue_length", priority="standard") or 0) == 0
    assert gw.state.admission.in_flight == 0
