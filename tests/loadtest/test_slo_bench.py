"""slo_bench's statistics: rounds pooled per class, and the p99 ratio's bootstrap interval."""

from __future__ import annotations

import random

from loadtest.runner import BenchResult, RequestRecord
from loadtest.slo_bench import markdown, p99_ratio, summarise


def _ttfts(seed: int, n: int, scale: float = 1.0) -> list[float]:
    rng = random.Random(seed)
    return [scale * rng.lognormvariate(-3, 1) for _ in range(n)]


def test_the_same_distribution_gives_a_ratio_near_1_with_an_interval_around_it():
    ratio, low, high = p99_ratio(_ttfts(1, 600), _ttfts(2, 600))
    assert low < 1.0 < high
    assert 0.6 < ratio < 1.6


def test_a_twice_as_slow_arm_is_told_apart_from_luck():
    ratio, low, high = p99_ratio(_ttfts(1, 600), _ttfts(2, 600, scale=2.0))
    assert ratio > 1.4 and low > 1.2, (ratio, low, high)


def test_too_few_requests_give_no_ratio():
    assert p99_ratio(_ttfts(1, 10), _ttfts(2, 600)) is None


def _result(records: list[RequestRecord]) -> BenchResult:
    return BenchResult("r", "slo-mix", {}, "t", "open", 1.0, None, 0.0, 1.0, records)


def _record(cls: str, ttft: float | None, status: int = 200) -> RequestRecord:
    return RequestRecord(index=0, start=0.0, kind="chat", priority=cls, status=status, ttft=ttft)


def test_rounds_are_pooled_per_class_and_429s_count_as_misses():
    one = _result([_record("critical", 0.1), _record("critical", 0.9), _record("sheddable", None, 429)])
    two = _result([_record("critical", 0.2), _record("sheddable", 0.3)])
    row = summarise([one, two], span_s=2.0)
    critical, sheddable = row["classes"]["critical"], row["classes"]["sheddable"]
    assert (critical["sent"], critical["ok"], critical["attainment"]) == (3, 3, 0.667)  # 0.9 s > 500 ms
    assert (sheddable["sent"], sheddable["shed"], sheddable["attainment"]) == (2, 1, 0.5)
    assert row["sent"] == 5 and row["goodput_rps"] == 1.5  # 3 met over 2 s
    out = {"capacity_rps": 1, "duration_s": 1, "rounds": 2}
    out["runs"] = [{**row, "load": "1x", "policy": "slo-aware"}]
    out["runs"][0]["p99_vs_default"] = {c: [1.0, 0.9, 1.1] for c in row["classes"]}
    table = markdown(out)
    assert "2 round(s) per arm" in table and "1.00 [0.90, 1.10]" in table
