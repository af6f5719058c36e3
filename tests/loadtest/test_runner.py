"""End-to-end runner/report/CLI tests against two real simulator replicas on 127.0.0.1."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loadtest.bench_cli import add_bench_arguments, parse_params, run_bench
from loadtest.report import markdown_table, plot, read_json, summarize, write_json
from loadtest.runner import DirectRoundRobinTarget, GatewayTarget, _sum_samples, run_benchmark
from loadtest.simulator import SimConfig, running_simulator
from loadtest.workloads import make_workload

MODEL = "sim-llama"
TINY_SHARED = {
    "num_groups": 2,
    "prompts_per_group": 6,
    "system_prompt_len": 96,
    "question_len": 8,
    "output_len": 6,
}


@pytest.fixture
async def replicas() -> AsyncIterator[list[str]]:
    cfg = {"port": 0, "time_scale": 50, "kv_blocks": 256, "block_size": 16, "model": MODEL}
    async with running_simulator(SimConfig(**cfg)) as a, running_simulator(SimConfig(**cfg)) as b:
        yield [a.url, b.url]


def _finite(*values: float | None) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


async def test_shared_prefix_direct_rr_report(replicas: list[str], tmp_path: Path) -> None:
    wl = make_workload("shared-prefix", model=MODEL, seed=1, **TINY_SHARED)
    target = DirectRoundRobinTarget(replicas)
    res = await run_benchmark(
        wl, target, concurrency=2, max_requests=100, deadline_s=15, progress=False, name="direct-rr"
    )
    s = summarize(res)
    assert (s.requests, s.ok, s.errors) == (12, 12, 0), [r.error for r in res.records if not r.ok]
    assert res.stopped_by == "completed"
    assert _finite(s.ttft_p50, s.ttft_p90, s.ttft_p99, s.itl_p50, s.itl_p99, s.e2e_p50, s.e2e_p99)
    assert s.ttft_p50 <= s.ttft_p99  # type: ignore[operator]
    assert s.req_per_s > 0 and s.output_tok_per_s > 0
    assert sorted(s.replica_requests) == sorted(replicas)
    assert sum(s.replica_requests.values()) == s.ok
    assert s.load_max_mean == pytest.approx(1.0)  # round-robin over 12 requests
    for rec in res.records:
        assert rec.prompt_tokens > 96 and rec.completion_tokens == 6 and len(rec.itls) >= 1
    # later prompts of a group repeat its system prompt on a replica that has seen it
    assert s.cached_tokens > 0 and 0 < s.usage_hit_ratio < 1  # type: ignore[operator]
    assert s.replica_hit_ratio is not None and s.replica_hit_ratio > 0
    assert sum(st.requests for st in res.replica_stats) == s.ok

    path = write_json([res], tmp_path / "out" / "run.json")
    data = json.loads(path.read_text())
    assert data[0]["summary"]["ok"] == 12 and len(data[0]["records"]) == 12
    again = read_json(path)
    assert summarize(again[0]) == s
    pngs = plot([res, again[0]], tmp_path / "plots")
    assert len(pngs) == 2 and all(p.suffix == ".png" and p.stat().st_size > 1000 for p in pngs)
    md = markdown_table([res])
    assert md.startswith("| metric | direct-rr |") and "TTFT p99" in md


async def test_multi_turn_sessions_are_sequential_and_feed_answers_back(replicas: list[str]) -> None:
    wl = make_workload("multi-turn", model=MODEL, num_users=3, num_rounds=3, scale=0.03)
    res = await run_benchmark(
        wl, GatewayTarget(replicas[0]), rate=math.inf, concurrency=2, max_requests=50, deadline_s=15,
        progress=False,
    )  # fmt: skip
    assert len(res.records) == 9 and all(r.ok for r in res.records)
    by_session: dict[str | None, list] = {}
    for rec in res.records:
        by_session.setdefault(rec.session_id, []).append(rec)
    assert len(by_session) == 3
    for recs in by_session.values():
        assert [r.turn for r in recs] == [0, 1, 2]
        for prev, nxt in itertools.pairwise(recs):
            assert nxt.start >= prev.start + prev.e2e - 1e-3  # sent only after the previous turn ended
            assert nxt.prompt_tokens > prev.prompt_tokens + prev.completion_tokens  # answer appended
            assert nxt.cached_tokens >= prev.prompt_tokens - 16  # same replica: whole history cached
    assert summarize(res).usage_hit_ratio > 0.3  # type: ignore[operator]


async def test_bounds_and_errors(replicas: list[str]) -> None:
    wl = make_workload("sharegpt-like", model=MODEL, num_requests=500, scale=0.05)
    res = await run_benchmark(wl, DirectRoundRobinTarget(replicas), concurrency=2, max_requests=5,
                              deadline_s=15, progress=False)  # fmt: skip
    assert len(res.records) == 5 and res.stopped_by == "max_requests"

    res = await run_benchmark(wl, DirectRoundRobinTarget(replicas), rate=5, max_requests=500,
                              deadline_s=0.6, progress=False)  # fmt: skip
    assert res.stopped_by == "deadline" and res.duration_s < 3
    assert 0 < len(res.records) < 20

    bad = make_workload("burst", model=MODEL, num_requests=4, scale=0.05)
    dead = "http://127.0.0.1:9"  # discard port: nothing listens, connection refused
    res = await run_benchmark(bad, DirectRoundRobinTarget([replicas[0], dead]), concurrency=2,
                              max_requests=4, deadline_s=10, replica_urls=[dead], progress=False)  # fmt: skip
    s = summarize(res)
    assert (s.ok, s.errors, s.errors_by_status) == (2, 2, {"no-response": 2})
    assert res.replica_stats[0].error is not None and s.replica_hit_ratio is None
    assert {r.priority for r in res.records} <= {"critical", "standard", "sheddable"}


async def test_bench_cli_end_to_end(replicas: list[str], tmp_path: Path, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    argv = ["--workload", "shared-prefix", "--concurrency", "2", "--requests", "8", "--no-progress"]
    argv += [f"--param={k}={v}" for k, v in TINY_SHARED.items()]
    argv += ["--out", str(tmp_path), "--name", "rr"]
    for url in replicas:
        argv += ["--direct", url]
    assert await run_bench(parser.parse_args(argv)) == 0
    assert (tmp_path / "rr.json").exists() and (tmp_path / "ttft_cdf.png").exists()
    assert (tmp_path / "replica_load.png").exists() and "| rr |" in (tmp_path / "comparison.md").read_text()
    gw = [*argv[: argv.index("--out")], "--out", str(tmp_path), "--name", "one", "--target", replicas[0]]
    gw += ["--compare", str(tmp_path / "rr.json")]
    assert await run_bench(parser.parse_args(gw)) == 0
    table = (tmp_path / "comparison.md").read_text()
    assert "| rr | one |" in table
    assert "llm-gateway benchmark" in capsys.readouterr().out
    assert await run_bench(parser.parse_args([*argv, "--param", "bogus=1"])) == 2


def test_parse_params_and_metric_parsing() -> None:
    assert parse_params(["a=1", "b=0.5", "c=x", "d-e=true"]) == {"a": 1, "b": 0.5, "c": "x", "d_e": True}
    with pytest.raises(ValueError):
        parse_params(["novalue"])
    text = (
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{model_name="a"} 3\n'
        'vllm:prefix_cache_hits_total{model_name="b"} 4\n'
    )
    assert _sum_samples(text, ("vllm:prefix_cache_hits_total",)) == 7
    assert _sum_samples(text, ("vllm:prefix_cache_queries_total",)) == 0
