"""agent_bench end to end on a small simulated fleet: every session's turns arrive, the hit
ratio comes from the replicas' own counters, and rounds are reported as medians."""

from __future__ import annotations

import json

import pytest

from loadtest import agent_bench

pytestmark = pytest.mark.slow

SMALL = [
    "--replicas", "2", "--sessions", "4", "--turns", "3", "--system-words", "200",
    "--turn-words", "40", "--output-tokens", "8", "--kv-blocks", "256", "--time-scale", "20",
]  # fmt: skip


def test_every_turn_is_measured_and_the_shared_prompt_hits(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*SMALL, "--policies", "round-robin,session-aware", "--rounds", "2", "--json"]
    assert agent_bench.main(argv) == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])}
    assert set(rows) == {"round-robin", "session-aware"}
    for row in rows.values():
        assert row["requests"] == 4 * 3  # one streamed TTFT per turn: each turn got a content event
        low, high = row["hit_range"]
        # Turns 2 and 3 resend turn 1 and the 200-word system prompt: hits come from the
        # replicas' vllm:prefix_cache_hits counters, so 0 would mean they were not read.
        assert 0.2 < low <= row["hit_ratio"] <= high < 1.0
        assert row["per_turn_hit"][0] == 0.0  # the first turns all start at once: nothing cached yet
        assert all(h is not None and h > 0 for h in row["per_turn_hit"][1:])  # usage was read
    # Pinned sessions find their whole history; round-robin finds it on every other turn.
    assert rows["session-aware"]["hit_ratio"] > rows["round-robin"]["hit_ratio"]
