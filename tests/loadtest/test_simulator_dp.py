"""The simulator's ``--data-parallel-size`` against what vLLM 0.32 does, on real sockets.

Checked against one real CPU vLLM with ``--data-parallel-size 2`` (see
``tests/e2e_vllm/test_data_parallel.py``): the header picks the rank, an out-of-range rank
is this exact 400, ``/kv_event_sources`` is keyed by rank with ports offset by the rank,
and its counters carry ``engine="<rank>"`` per rank (its scheduler gauges: rank 0 only).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from loadtest.harness.ports import free_port_block
from loadtest.simulator import running_simulator

MODEL = "sim-llama"
PROMPT = "the quick brown fox jumps over the lazy dog " * 8


async def complete(
    http: aiohttp.ClientSession, url: str, prompt: str, rank: str | None = None, max_tokens: int = 2
) -> tuple[int, dict[str, Any]]:
    headers = {"X-data-parallel-rank": rank} if rank is not None else {}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    async with http.post(url + "/v1/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.json()


def cached(answer: dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_the_header_picks_the_rank_and_each_rank_has_its_own_cache(http) -> None:
    async with running_simulator(data_parallel_size=2, time_scale=50.0) as sim:
        dp = sim.state.dp
        assert dp is not None
        status, first = await complete(http, sim.url, PROMPT, "1")
        assert status == 200 and cached(first) == 0
        assert dp.picked == [0, 1] and dp.engines[1].prompt_tokens_total > 0
        assert dp.engines[0].prompt_tokens_total == 0
        _, again = await complete(http, sim.url, PROMPT, "1")
        assert cached(again) > 0  # rank 1 holds it
        _, other = await complete(http, sim.url, PROMPT, "0")
        assert cached(other) == 0  # rank 0 has its own, empty, cache


async def test_out_of_range_rank_is_vllms_400_and_a_non_integer_is_ignored(http) -> None:
    async with running_simulator(data_parallel_size=2, time_scale=50.0) as sim:
        status, body = await complete(http, sim.url, PROMPT, "2")
        assert status == 400
        assert body["error"] == {
            "message": "data_parallel_rank 2 is out of range [0, 2).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        status, _ = await complete(http, sim.url, PROMPT, "-1")
        assert status == 400
        status, _ = await complete(http, sim.url, PROMPT, "one")
        assert status == 200  # vLLM: an unparsable header is no header
        assert sum(sim.state.dp.picked) == 1  # type: ignore[union-attr]


async def test_without_the_header_the_least_loaded_rank_takes_it(http) -> None:
    async with running_simulator(data_parallel_size=2, time_scale=5.0) as sim:
        dp = sim.state.dp
        assert dp is not None
        # Long generations at once: each new one sees the other rank busier and goes there.
        sends = (complete(http, sim.url, f"{i} {PROMPT}", max_tokens=40) for i in range(6))
        results = await asyncio.gather(*sends)
        assert all(status == 200 for status, _ in results)
        assert dp.picked == [3, 3]


async def test_metrics_carry_the_rank_in_the_engine_label_as_vllms_do(http) -> None:
    async with running_simulator(data_parallel_size=2, time_scale=50.0) as sim:
        await complete(http, sim.url, PROMPT, "1")
        await complete(http, sim.url, PROMPT, "1")
        async with http.get(sim.url + "/metrics") as resp:
            text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    names = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:prompt_tokens",
             "vllm:cache_config_info", "vllm:time_to_first_token_seconds")  # fmt: skip
    for name in names:
        engines = {s.labels.get("engine") for s in families[name].samples}
        assert engines == {"0", "1"}, name
    # As measured on vLLM 0.32 (CPU, --data-parallel-size 2): the scheduler gauges are rank 0's only.
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert {s.labels.get("engine") for s in families[name].samples} == {"0"}, name
    hits = {s.labels["engine"]: s.value for s in families["vllm:prefix_cache_hits"].samples}
    assert hits["0"] == 0 and hits["1"] > 0
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1  # one family, both ranks


async def test_kv_events_per_rank_carry_the_rank(http) -> None:
    pub = free_port_block(4)  # rank R publishes on pub + R and replays on replay + R
    replay = pub + 2
    ports = {"kv_events_port": pub, "kv_events_replay_port": replay}
    async with running_simulator(data_parallel_size=2, time_scale=50.0, kv_events=True, **ports) as sim:
        async with http.get(sim.url + "/kv_event_sources") as resp:
            sources = await resp.json()
        assert sorted(sources) == ["0", "1"]
        # vLLM's offset_endpoint_port: rank R publishes on port + R (and replays on replay + R).
        assert sources["0"]["endpoint"] == f"tcp://*:{pub}"
        assert sources["1"]["endpoint"] == f"tcp://*:{pub + 1}"
        assert sources["1"]["replay_endpoint"] == f"tcp://*:{replay + 1}"
        ctx = zmq.asyncio.Context()
        subs = []
        try:
            for rank in ("0", "1"):
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(sources[rank]["endpoint"].replace("*", "127.0.0.1"))
                subs.append(sub)
            await asyncio.sleep(0.3)  # the slow joiner: let the subscriptions reach the publishers
            await complete(http, sim.url, PROMPT, "1")
            async with asyncio.timeout(5):
                _, _, payload = await subs[1].recv_multipart()
            _, events, rank = msgspec.msgpack.decode(payload)
            assert rank == 1 and events[0]["type"] == "BlockStored"
            assert await subs[0].poll(300) == 0  # rank 0 did nothing, so published nothing
        finally:
            for sub in subs:
                sub.close(0)
            ctx.term()
