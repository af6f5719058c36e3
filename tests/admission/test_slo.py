"""Per-request SLOs: the x-slo-* headers (validated), the class defaults, the queue's deadline order."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from gateway.request.slo import SloOptions, parse_slo
from gateway.request.types import Priority
from tests.admission.conftest import admission_gateway, body, gated, wait_queue
from tests.support.harness import Gateway


async def _post(
    http: aiohttp.ClientSession, gw: Gateway, payload: dict[str, Any], **headers: str
) -> tuple[int, Any]:
    async with http.post(gw.url + "/v1/chat/completions", json=payload, headers=headers) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


@pytest.mark.parametrize("header", ["x-slo-ttft-ms", "x-slo-tpot-ms"])
@pytest.mark.parametrize("value", ["abc", "-5", "0", "nan", "inf", "1e9", ""])
async def test_a_bad_slo_header_is_a_400_in_the_openai_format(
    start_upstream, start_gateway, http, header: str, value: str
) -> None:
    up = await start_upstream()
    gw = await start_gateway([up.url])
    status, payload = await _post(http, gw, body(), **{header: value})
    assert status == 400, payload
    error = payload["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == header
    assert header in error["message"]
    assert up.requests == []  # refused before anything was sent


async def test_valid_slo_headers_are_accepted(start_upstream, start_gateway, http) -> None:
    up = await start_upstream()
    gw = await start_gateway([up.url])
    status, _ = await _post(http, gw, body(), **{"x-slo-ttft-ms": " 250.5 ", "x-slo-tpot-ms": "40"})
    assert status == 200


def test_headers_win_over_the_class_defaults_and_give_a_deadline() -> None:
    options = SloOptions(defaults={Priority.SHEDDABLE: (2000.0, None), Priority.STANDARD: (None, 50.0)})
    default = parse_slo({}, Priority.SHEDDABLE, options, now=100.0)
    assert default is not None
    assert (default.ttft_ms, default.tpot_ms, default.deadline) == (2000.0, None, 102.0)
    tpot_only = parse_slo({}, Priority.STANDARD, options, now=100.0)
    assert tpot_only is not None and tpot_only.deadline is None and tpot_only.tpot_ms == 50.0
    header = parse_slo({"x-slo-ttft-ms": "500"}, Priority.SHEDDABLE, options, now=100.0)
    assert header is not None and (header.ttft_ms, header.tpot_ms, header.deadline) == (500.0, None, 100.5)
    assert parse_slo({}, Priority.CRITICAL, options) is None  # no objective: routed as before SLOs


async def test_config_defaults_reach_the_request(start_upstream, start_gateway, http) -> None:
    up = await start_upstream()
    defaults = {"sheddable": {"ttft_ms": 1500}, "critical": {"tpot_ms": 20}}
    gw = await start_gateway([up.url], admission={"slo": {"defaults": defaults}})
    options = gw.state.parse_options.slo
    assert options.defaults[Priority.SHEDDABLE] == (1500.0, None)
    assert options.defaults[Priority.CRITICAL] == (None, 20.0)
    status, _ = await _post(http, gw, body(), **{"x-priority": "sheddable"})
    assert status == 200


async def _served_order(
    spawn, stack, start_upstream, start_gateway, http, arrivals: list[tuple[str, dict[str, str]]]
) -> list[str]:
    """One slot, held by a stream: ``arrivals`` (name, headers) queue in turn; the order served."""
    up = await start_upstream()
    gw = await admission_gateway(start_gateway, [up.url], max_concurrency=1, queue_timeout_s=15)
    gated(stack, up)
    holder = spawn(_post(http, gw, body("holder", stream=True)))
    await asyncio.wait_for(up.first_chunk_sent.wait(), 3)
    queued = []
    for i, (name, headers) in enumerate(arrivals):
        queued.append(spawn(_post(http, gw, body(name), **headers)))
        await wait_queue(http, gw, i + 1)
    up.gate.set()
    results = await asyncio.gather(holder, *queued)
    assert [status for status, _ in results] == [200] * (len(arrivals) + 1)
    return [r.json["messages"][0]["content"] for r in up.requests][1:]


async def test_the_standard_queue_is_earliest_deadline_first(
    spawn, stack, start_upstream, start_gateway, http
) -> None:
    """One tenant, one slot: queued requests leave in deadline order; without an SLO a
    request's deadline is its arrival + queue_timeout_s, so it goes after tighter ones; one
    already overdue goes last (it has missed anyway: serving it first would make the rest miss)."""
    classes = [("overdue", "1"), ("none", None), ("loose", "9000"), ("mid", "5000"), ("tight", "1000")]
    arrivals = [(name, {"x-slo-ttft-ms": slo} if slo else {}) for name, slo in classes]
    order = await _served_order(spawn, stack, start_upstream, start_gateway, http, arrivals)
    assert order == ["tight", "mid", "loose", "none", "overdue"], order


async def test_tenants_take_turns_and_each_tenant_is_served_earliest_deadline_first(
    spawn, stack, start_upstream, start_gateway, http
) -> None:
    """Deadline order is within a tenant, fairness across tenants: tenant A's tight request
    does not jump tenant B's turn, and within each tenant the tightest goes first."""
    requests = [("A", "A-loose", "9000"), ("A", "A-tight", "2000"), ("A", "A-mid", "5000"),
                ("B", "B-loose", "8000"), ("B", "B-tight", "3000")]  # fmt: skip
    arrivals = [(name, {"x-slo-ttft-ms": slo, "x-tenant-id": tenant}) for tenant, name, slo in requests]
    order = await _served_order(spawn, stack, start_upstream, start_gateway, http, arrivals)
    assert order == ["A-tight", "B-tight", "A-mid", "B-loose", "A-loose"], order
