"""One real vLLM CPU server with ``--data-parallel-size 2`` behind the gateway (fleet/dp.py).

vLLM 0.32's CPU build runs two schedulers (two engine cores) behind one port: its series
carry ``engine="0"``/``"1"``, ``/kv_event_sources`` lists both ranks (ports offset by the
rank), and ``X-data-parallel-rank`` picks the rank (out of range: a 400). The gateway must
find both ranks on its own, follow both event streams, and send a repeated document to
the rank holding it: the engine's own ``cached_tokens`` prove it.

Run it alone (``pytest tests/e2e_vllm/test_data_parallel.py``): its replica is two more
engine processes on a 2-core machine, beside the session fleet's two if those are up.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from gateway.fleet.dp import rank_out_of_range
from gateway.http.state import STATE
from loadtest.realvllm.fleet import Replica, ReplicaOptions, start_replicas, stop_replicas
from tests.e2e_vllm.conftest import BLOCK_SIZE, NUM_BLOCKS, START_TIMEOUT_S
from tests.e2e_vllm.helpers import MODEL, engine_metric
from tests.prefix.conftest import GatewayProcessless, gateway_config

pytestmark = pytest.mark.slow
DP = ReplicaOptions(
    num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, kv_events=True, extra_args=("--data-parallel-size", "2")
)
EXACT = {"exact": "auto", "kv_events": {"rediscover_s": 0.5, "tokenize_timeout_s": 5.0}}


@pytest.fixture(scope="module")
def dp_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    (replica,) = start_replicas(1, DP, log_dir=tmp_path_factory.mktemp("vllm-dp"), timeout_s=START_TIMEOUT_S)
    try:
        yield replica
    finally:
        stop_replicas([replica])


async def test_the_server_is_two_ranks_behind_one_url(
    dp_replica: Replica, http: aiohttp.ClientSession
) -> None:
    async with http.get(dp_replica.url + "/kv_event_sources") as resp:
        sources = await resp.json()
    assert sorted(sources) == ["0", "1"]
    port0 = int(sources["0"]["endpoint"].rsplit(":", 1)[1])
    assert sources["1"]["endpoint"].endswith(f":{port0 + 1}")  # vLLM offsets the port by the rank
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 1}
    rank2 = {"X-data-parallel-rank": "2"}
    async with http.post(dp_replica.url + "/v1/completions", json=body, headers=rank2) as r:
        assert r.status == 400
        refusal = await r.read()
    assert json.loads(refusal)["error"]["message"] == "data_parallel_rank 2 is out of range [0, 2)."
    # The gateway's matcher takes the engine's own bytes for a refusal of rank 2, and only of it.
    assert rank_out_of_range(refusal, 2) and not rank_out_of_range(refusal, 1)


def ready(state: Any, names: list[str]) -> bool:
    """Both rank targets routed and both event streams live."""
    routed = [t.name for t in state.registry.targets()] == names
    return routed and all(state.prefix.exact.index.live(n) for n in names)


async def ask(http: aiohttp.ClientSession, gw: GatewayProcessless, text: str) -> tuple[str, int, int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"x-gateway-debug": "1"}) as r:
        assert r.status == 200, await r.text()
        answer: dict[str, Any] = json.loads(await r.read())
        endpoint = r.headers["x-gateway-endpoint"]
        predicted = int(r.headers["x-gateway-predicted-cached-tokens"])
    return endpoint, predicted, answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_a_repeated_document_goes_to_the_rank_that_cached_it(
    dp_replica: Replica, http: aiohttp.ClientSession, stack: Any
) -> None:
    async with http.post(dp_replica.url + "/reset_prefix_cache") as r:  # both ranks start empty:
        assert r.status == 200  # blocks an earlier test left on one rank made free room favour the other
    gw = GatewayProcessless(gateway_config([dp_replica.url], prefix=EXACT))
    await gw.start()
    stack.push_async_callback(gw.stop)
    assert gw.gateway is not None
    state = gw.gateway.app[STATE]
    host = dp_replica.url.split("://", 1)[1]
    names = [f"{host}#dp0", f"{host}#dp1"]
    async with asyncio.timeout(30):  # the ranks from the scrape, both streams from /kv_event_sources
        while not ready(state, names):  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    rng = random.Random(5)
    # Idle ranks tie, and ties are broken at random: with 6 documents all landed on one rank
    # 2 × 2⁻⁶ ≈ 3 % of runs by chance alone (a CI run did); with 10, 0.2 %.
    docs = [f"Report {d}: " + " ".join(f"w{rng.randint(0, 9999)}" for _ in range(120)) for d in range(10)]
    first = [(await ask(http, gw, doc + " Summarise it."))[0] for doc in docs]
    assert set(first) == set(names), first  # distinct documents spread over both ranks
    await asyncio.sleep(1.0)  # both ranks' BlockStored events applied
    for doc, endpoint in zip(docs, first, strict=True):
        served, predicted, cached = await ask(http, gw, doc + " List its points.")
        assert served == endpoint
        assert cached >= 2 * BLOCK_SIZE and predicted == cached  # the engine's own count
    for rank in ("0", "1"):
        hits = await engine_metric(http, dp_replica.url, "vllm:prefix_cache_hits_total", engine=rank)
        assert hits > 0, rank  # each rank served its own documents' repeats
