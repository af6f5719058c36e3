"""Short fault runs and a short soak: real gateway, replica processes and sockets on 127.0.0.1.

Each run is bounded (30 req/s for 6 s on 3 replicas; a fault lands at 2 s) and takes
well under 20 s. The invariants asserted hold for the gateway as it is; the ejection
checks are switched by ``EXPECT_EJECTION``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from loadtest.faults import ScenarioOptions, dedupe_times, ejection_times, parse_gateway_metrics, run_scenario
from loadtest.soak import SoakOptions, read_rss_kib, run_soak

# The gateway's circuit breaker (outlier ejection on 5xx and refused connections) is in
# gateway/: a faulted replica must stop getting traffic within the 2 s target. Set to
# False to check only the invariants that held before ejection existed.
EXPECT_EJECTION = True
EJECTION_TARGET_S = 2.0

SHORT = {"rate": 30.0, "duration_s": 6.0, "replicas": 3, "request_timeout_s": 8.0}


def _check_structure(result: dict[str, Any], scenario: str) -> None:
    assert result["scenario"] == scenario
    records = result["records"]
    assert len(records) == result["sent"]
    # Poisson arrivals at 30/s for 6 s: ~180 requests; bounds far outside the noise.
    assert 110 <= result["sent"] <= 260, result["sent"]
    assert result["sent"] == result["ok"] + result["failed"]
    assert sum(result["failed_by_reason"].values()) == result["failed"]
    parts = ("failed_before_first_byte", "failed_before_content", "failed_mid_stream")
    assert sum(result[k] for k in parts) == result["failed"]
    for r in records:  # the buckets follow from what each client saw
        if r["streamed"]:
            assert r["stream"] and r["ttft"] is not None
            assert r["events"] >= (2 if r["kind"] == "chat" else 1)  # a chat stream opens with a role chunk
    assert result["inject_at_s"] == pytest.approx(2.0, abs=1.0)  # late only if the box stalls
    assert result["faulted_endpoint"] in result["replicas"]
    assert {r["stream"] for r in records} == {True, False}  # both kinds were exercised
    starts = [r["start"] for r in records]
    assert starts == sorted(starts) and 0 <= starts[0] and starts[-1] < SHORT["duration_s"]
    for side in ("before", "after"):
        lat = result["latency_ms"][side]
        assert lat["n"] > 20 and 0 < lat["p50"] <= lat["p99"] < 10_000, lat
    # The faulted replica carried traffic before the fault (it is chosen as the busiest).
    before = [r for r in records if r["start"] < result["inject_at_s"]]
    assert any(r["endpoint"] == result["faulted_endpoint"] and r["status"] == 200 for r in before)
    # Every successful answer names a replica of this fleet.
    assert {r["endpoint"] for r in records if r["outcome"] == "ok"} <= set(result["replicas"])
    json.dumps(result)  # the report must be JSON as it is


def _check_ejection(result: dict[str, Any]) -> None:
    ej = result["ejection"]
    assert ej is not None and ej["last_sent_s"] >= 0 and ej["attempts_after_injection"] >= 0
    if EXPECT_EJECTION:
        assert ej["ejected_after_s"] is not None and ej["ejected_after_s"] <= EJECTION_TARGET_S, ej
        assert ej["gateway_marked_out_s"] is not None and ej["gateway_marked_out_s"] <= EJECTION_TARGET_S, ej
        assert result["targets"]["ejection_within_2s"] is True
    else:
        assert ej["ejected_after_s"] is None or ej["ejected_after_s"] >= 0


async def test_error_scenario(tmp_path: Path) -> None:
    result = await run_scenario("error", ScenarioOptions(**SHORT, log_dir=tmp_path))
    _check_structure(result, "error")
    faulted, at = result["faulted_endpoint"], result["inject_at_s"]
    # The fault was real and reached the gateway: 500s from that replica, re-sent elsewhere.
    assert result["gateway"]["upstream_errors"][faulted].get("http_500", 0) >= 1
    assert result["gateway"]["retries"].get("http_500", 0) >= 1
    # A 500 comes before the first byte, so the gateway re-sends it: clients see no failure.
    assert result["failed"] == 0, result["failed_by_reason"]
    assert result["responses_5xx"] == 0
    assert result["targets"]["no_failures_before_streaming"] is True
    # Nothing sent after the fault was answered by the faulted replica.
    late = [r for r in result["records"] if r["start"] > at + 0.05 and r["endpoint"] == faulted]
    assert late == []
    _check_ejection(result)


async def test_kill_scenario(tmp_path: Path) -> None:
    result = await run_scenario("kill", ScenarioOptions(**SHORT, log_dir=tmp_path))
    _check_structure(result, "kill")
    faulted, at = result["faulted_endpoint"], result["inject_at_s"]
    # Refused connections and requests cut before any response byte are re-sent elsewhere:
    # only streams already committed by the killed process (its first chunk relayed) may fail.
    assert result["failed_before_first_byte"] == 0, result["failed_by_reason"]
    failed = [r for r in result["records"] if r["outcome"] != "ok"]
    assert all(r["stream"] and r["events"] >= 1 and r["start"] < at for r in failed), failed
    assert set(result["failed_by_reason"]) <= {"stream_error", "truncated"}
    assert result["responses_5xx"] == 0
    assert not [r for r in result["records"] if r["start"] > at + 0.05 and r["endpoint"] == faulted]
    # The gateway noticed the dead process (refused connects, health checks).
    assert result["ejection"]["gateway_marked_out_s"] is not None
    _check_ejection(result)


async def test_soak_samples_the_gateway_process(tmp_path: Path) -> None:
    opts = SoakOptions(duration_s=5.0, rate=20.0, sample_every_s=1.0, replicas=2, log_dir=tmp_path)
    report = await run_soak(opts)
    samples = report["samples"]
    assert len(samples) >= 6  # t = 0..5 and the final one
    assert [s["t_s"] for s in samples] == sorted(s["t_s"] for s in samples)
    # A Python aiohttp gateway holds tens of MiB; this is its RSS, not a placeholder.
    assert all(20 * 1024 < s["rss_kib"] < 4 * 1024 * 1024 for s in samples), samples
    assert report["gateway_pid"] != os.getpid()
    assert read_rss_kib(report["gateway_pid"]) is None  # the gateway is stopped: no such process now
    assert report["rss_after_warmup_at_s"] >= 1.0
    expected = (report["rss_end_kib"] - report["rss_after_warmup_kib"]) / report["rss_after_warmup_kib"] * 100
    assert report["growth_pct"] == pytest.approx(expected, abs=0.01)
    assert report["target_met"] is (report["growth_pct"] < 10)
    assert report["errors"] == 0, report["errors_by_reason"]
    assert report["served"] == report["requests"] >= 50
    kinds = report["by_kind"]  # the mix: chat and completions, streaming and not
    assert {"chat/stream", "chat/plain", "completion/stream", "completion/plain"} <= set(kinds)
    json.dumps(report)


def test_read_rss_matches_statm() -> None:
    """VmRSS parsing agrees with the kernel's other view of the same number."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    statm_kib = pages * os.sysconf("SC_PAGE_SIZE") // 1024
    assert read_rss_kib(os.getpid()) == pytest.approx(statm_kib, rel=0.1)


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ([], (0.0, 0.0, 0)),  # nothing reached the replica after the fault
        ([1.0, 10.1, 10.2, 10.3], (0.3, 0.3, 0)),  # events before injection do not count
        ([10.1, 10.2, 10.3, 11.5, 13.6, 17.7], (7.7, 0.3, 3)),  # ejected; half-open probes follow
        ([10 + 0.3 * i for i in range(33)], (9.6, None, 0)),  # traffic never stopped
        ([10.5, 12.0, 12.2, 12.4, 12.6, 12.8, 13.0], (3.0, 3.0, 0)),  # a lull is not an ejection
    ],
)
def test_ejection_times(events: list[float], expected: tuple[float, float | None, int]) -> None:
    last, ejected, probes = ejection_times(events, inject_at=10.0, load_end=20.0, gap_s=1.0)
    assert (round(last, 6), None if ejected is None else round(ejected, 6), probes) == expected


def test_probe_seen_by_three_witnesses_counts_once() -> None:
    """Half-open probes as the client, /metrics and /admin/state each see them, a poll apart."""
    probes = [11.2, 13.5, 17.9]
    seen = sorted([10.05, 10.1, *probes, *(p + 0.04 for p in probes), *(p + 0.11 for p in probes)])
    merged = dedupe_times(seen, 0.15)
    assert merged == [10.05, 11.2, 13.5, 17.9]
    assert ejection_times(merged, inject_at=10.0, load_end=20.0, gap_s=1.0) == (
        pytest.approx(7.9),
        pytest.approx(0.05),
        3,
    )
    # without the merge the triples look like bursts of traffic, not probes
    assert ejection_times(seen, inject_at=10.0, load_end=20.0, gap_s=1.0)[1] != pytest.approx(0.05)


def test_parse_gateway_metrics_counts_attempts() -> None:
    text = """
# TYPE llm_gateway_requests counter
llm_gateway_requests_total{model="m",endpoint="a:1",status="200"} 5.0
llm_gateway_requests_total{model="m",endpoint="a:1",status="400"} 1.0
# TYPE llm_gateway_upstream_errors counter
llm_gateway_upstream_errors_total{endpoint="a:1",kind="http_500"} 2.0
llm_gateway_upstream_errors_total{endpoint="a:1",kind="mid_stream"} 3.0
# TYPE llm_gateway_endpoint_in_flight_requests gauge
llm_gateway_endpoint_in_flight_requests{endpoint="a:1"} 4.0
llm_gateway_endpoint_in_flight_requests{endpoint="b:2"} 0.0
# TYPE llm_gateway_retries counter
llm_gateway_retries_total{reason="http_500"} 2.0
# TYPE llm_gateway_endpoint_ejected gauge
llm_gateway_endpoint_ejected{endpoint="a:1"} 1.0
"""
    c = parse_gateway_metrics(text)
    # a mid-stream error is also an answered request: counted once
    assert c.attempts == {"a:1": 5 + 1 + 2 + 4, "b:2": 0.0}
    assert c.upstream_errors == {"a:1": {"http_500": 2.0, "mid_stream": 3.0}}
    assert c.retries == {"http_500": 2.0} and c.ejected == {"a:1": 1.0}
    assert not math.isnan(sum(c.requests.values()))
