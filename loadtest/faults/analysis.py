"""Phase accounting of one fault run: failures by when they happened, latency before and after,
the gateway's counter deltas, and when the faulted replica stopped getting attempts."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from loadtest.harness.steady import LoadRun, RequestOutcome
from loadtest.harness.timeline import dedupe_times, ejection_times
from loadtest.harness.watch import GatewayCounters, GatewayWatcher, ReplicaWatcher
from loadtest.report import percentile

__all__ = ["TARGET_EJECTION_S", "Injection", "analyse", "client_lag_ms"]

TARGET_EJECTION_S = 2.0


@dataclass
class Injection:
    """What the injector did, in seconds since the load's start."""

    at: float | None = None
    endpoint: str | None = None
    redis_restarted_at: float | None = None
    replica_watcher: ReplicaWatcher | None = None


def _ms(values: list[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else round(p * 1000, 1)


def client_lag_ms(records: list[RequestOutcome]) -> dict[str, float | None]:
    """p99 and max of the client's own send lag (see ``RequestOutcome.send_lag``)."""
    lags = [r.send_lag for r in records]
    return {"p99": _ms(lags, 99), "max": _ms(lags, 100)}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    out = {k: v - before.get(k, 0.0) for k, v in sorted(after.items())}
    return {k: v for k, v in out.items() if v}


def _sent_after(watcher: GatewayWatcher, endpoint: str, at: float) -> float:
    """Attempts sent to ``endpoint`` after ``at``: the rises of its attempt count (an attempt the
    gateway abandons without counting it, e.g. re-sent because its endpoint was ejected
    meanwhile, lowers the count; a rise within the same poll interval may hide behind it)."""
    total, previous = 0.0, None
    for t, counters in watcher.series:
        value = counters.attempts.get(endpoint, 0.0)
        if previous is not None and t > at:
            total += max(0.0, value - previous)
        previous = value
    return total


def _marked_out(watcher: GatewayWatcher, endpoint: str, at: float) -> float | None:
    """First poll after ``at`` at which the gateway reported the endpoint unhealthy or ejected."""
    for t, c in watcher.series:
        if t >= at and (c.healthy.get(endpoint, 1.0) == 0 or c.ejected.get(endpoint, 0.0) == 1):
            return round(t - at, 3)
    return None


def _ejection(opts: Any, run: LoadRun, watcher: GatewayWatcher, inj: Injection) -> dict[str, Any]:
    assert inj.endpoint is not None and inj.at is not None
    sources = {
        "client_headers": [r.start for r in run.records if r.endpoint == inj.endpoint],
        "gateway_metrics": watcher.events.get(inj.endpoint, []),
        "replica_state": inj.replica_watcher.events if inj.replica_watcher is not None else [],
    }
    # One attempt is often seen by two or three witnesses a poll apart: count it once.
    merged = dedupe_times([t for times in sources.values() for t in times], 1.5 * opts.poll_s)
    last, ejected, probes = ejection_times(merged, inj.at, run.load_s, opts.gap_s)
    before = [c.attempts.get(inj.endpoint, 0.0) for t, c in watcher.series if t <= inj.at]
    return {
        "last_sent_s": round(last, 3),
        "ejected_after_s": None if ejected is None else round(ejected, 3),
        "attempts_after_ejection": probes,
        "attempts_before_injection_per_s": round(before[-1] / inj.at, 2) if before and inj.at > 0 else None,
        "attempts_after_injection": _sent_after(watcher, inj.endpoint, inj.at),
        "gateway_marked_out_s": _marked_out(watcher, inj.endpoint, inj.at),
        "last_seen_by_source_s": {
            name: round(max(after) - inj.at, 3) if (after := [t for t in times if t >= inj.at]) else None
            for name, times in sources.items()
        },
        "resolution_s": opts.poll_s,
        "attempt_times_s": [round(t - inj.at, 3) for t in merged if t >= inj.at],  # after injection
    }


def _latency(records: list[RequestOutcome], lo: float, hi: float) -> dict[str, Any]:
    values = [r.latency for r in records if r.ok and r.latency is not None and lo <= r.start < hi]
    return {"p50": _ms(values, 50), "p99": _ms(values, 99), "n": len(values)}


def _failures(records: list[RequestOutcome]) -> dict[str, Any]:
    failed = [r for r in records if not r.ok]
    before_first_byte = sum(1 for r in failed if not r.events)
    before_content = sum(1 for r in failed if r.events and not r.streamed)
    return {
        "sent": len(records),
        "ok": len(records) - len(failed),
        "failed": len(failed),
        "failed_by_reason": dict(sorted(Counter(r.outcome for r in failed).items())),
        # no byte of an answer / only a role-only chunk (the response was committed) / >= 1 content chunk
        "failed_before_first_byte": before_first_byte,
        "failed_before_content": before_content,
        "failed_mid_stream": len(failed) - before_first_byte - before_content,
        "responses_5xx": sum(1 for r in records if 500 <= r.status < 600),
    }


def _gateway_deltas(watcher: GatewayWatcher) -> dict[str, Any]:
    first = watcher.first or GatewayCounters()
    last = watcher.latest or GatewayCounters()
    return {
        "retries": _delta(last.retries, first.retries),
        "upstream_errors": {
            ep: d
            for ep in sorted(last.upstream_errors)
            if (d := _delta(last.upstream_errors[ep], first.upstream_errors.get(ep, {})))
        },
        "redis_fallbacks": _delta(last.redis_fallbacks, first.redis_fallbacks),
        "session_fallbacks": _delta(last.session_fallbacks, first.session_fallbacks),
        "retry_budget_exhausted": last.retry_budget_exhausted - first.retry_budget_exhausted,
        "metrics_polls_failed": watcher.failed_polls,
    }


def _targets(scenario: str, result: dict[str, Any]) -> dict[str, bool]:
    # The target: no failure of a request that had not started streaming (no content yet).
    before_streaming = result["failed_before_first_byte"] + result["failed_before_content"]
    targets: dict[str, bool] = {"no_failures_before_streaming": before_streaming == 0}
    if scenario == "redis":
        targets["no_5xx"] = result["responses_5xx"] == 0
    else:
        ejected = result["ejection"]["ejected_after_s"]
        targets["ejection_within_2s"] = ejected is not None and ejected <= TARGET_EJECTION_S
    return targets


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def analyse(
    scenario: str, opts: Any, run: LoadRun, watcher: GatewayWatcher, inj: Injection, names: list[str]
) -> dict[str, Any]:
    """The report of one scenario (``opts``: its ScenarioOptions); records included."""
    records = run.records
    at = inj.at if inj.at is not None else math.inf
    result: dict[str, Any] = {
        "scenario": scenario,
        "replicas": names,
        "rate": opts.rate,
        "duration_s": opts.duration_s,
        "load_s": round(run.load_s, 2),
        "faulted_endpoint": inj.endpoint,
        "inject_at_s": _rounded(inj.at),
        "redis_restarted_at_s": _rounded(inj.redis_restarted_at),
        **_failures(records),
        "client_send_lag_ms": client_lag_ms(records),
        "latency_ms": {"before": _latency(records, -math.inf, at), "after": _latency(records, at, math.inf)},
        "gateway": _gateway_deltas(watcher),
        "ejection": _ejection(opts, run, watcher, inj) if inj.endpoint is not None else None,
    }
    targets = _targets(scenario, result)
    if inj.redis_restarted_at is not None:
        result["latency_ms"]["redis_down"] = _latency(records, at, inj.redis_restarted_at)
    result["targets"] = targets
    result["targets_met"] = all(targets.values())
    result["records"] = [asdict(r) for r in records]
    return result
