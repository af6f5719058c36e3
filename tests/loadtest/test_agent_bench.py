"""agent_bench end to end on a small simulated fleet: every session's turns arrive, the hit
ratio comes from the replicas' own counters, and rounds are reported as medians."""

from __future__ import annotations

import argparse
import json

import pytest

from loadtest import agent_bench
from loadtest.simulator import SimConfig
from loadtest.simulator.server import start_runner

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


async def test_a_running_fleet_is_reset_and_counted_as_deltas() -> None:
    """The ``--engine vllm`` path (replicas that outlive the policies) on simulators: a second
    policy on the same fleet starts cold, and its hit ratio is its own, not the sum of both."""
    args = argparse.Namespace(
        engine="sim", model="sim-llama", sessions=4, turns=3, system_words=200, turn_words=40,
        output_tokens=8, apis="responses", gateway_process=False,
    )  # fmt: skip
    runners, urls = [], []
    for _ in range(2):
        runner, sim = await start_runner(SimConfig(port=0, time_scale=20.0, kv_blocks=256))
        runners.append(runner)
        urls.append(sim.url)
    try:
        first = await agent_bench.run_policy("session-aware", args, urls)
        again = await agent_bench.run_policy("session-aware", args, urls)
    finally:
        for runner in runners:
            await runner.cleanup()
    assert first["requests"] == again["requests"] == 12
    # Without the reset the second run would find turn 1 cached too. Counted as deltas, the same
    # workload queries the same tokens (summed, the second run's would be twice the first's);
    # the hit ratio itself depends on how the concurrent sessions' first turns interleave.
    assert again["per_turn_hit"][0] == 0.0
    assert again["queried_tokens"] == first["queried_tokens"] > 0
    assert 0.3 < again["hit_ratio"] < 0.9 and 0.3 < first["hit_ratio"] < 0.9
