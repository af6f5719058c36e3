"""``loadtest.kv_replay_stall`` measures a real replay through the gateway's own subscriber."""

from __future__ import annotations

from loadtest.kv_replay_stall import markdown, one_run


async def test_a_replay_run_reports_the_engines_blocks_and_the_loop_gap() -> None:
    row = await one_run(300, 4)
    assert row["indexed_blocks"] == row["engine_blocks"] == 4  # 299 removals applied, none lost
    assert row["fetches"] >= 1 and row["resets"] == 0
    assert 0 < row["worst_loop_gap_ms"] < 60_000 and row["to_live_s"] > 0
    assert "| 300 × 4 |" in markdown([row])
