"""A block size scraped from ``vllm:cache_config_info`` is used for exact keys until the stream's
first BlockStored: a garbage one must never fail a request."""

from __future__ import annotations

import pytest
import zmq
import zmq.asyncio

from tests.support.upstreams import vllm_metrics

from .helpers import EXACT, SourcesUpstream, chat, wait_for


@pytest.mark.parametrize("block_size", ["-16", "4611686018427387904"])
async def test_garbage_scraped_block_size_never_fails_a_request(stack, start_gateway, http, block_size):
    ctx = zmq.asyncio.Context()
    stack.callback(ctx.destroy, 0)
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")  # a live publisher that has sent nothing yet
    up = SourcesUpstream(("tiny",))
    up.metrics_text = vllm_metrics(model="tiny") + (
        f'vllm:cache_config_info{{block_size="{block_size}",num_gpu_blocks="1000",engine="0"}} 1\n'
    )
    up.kv_sources = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    await up.start()
    stack.push_async_callback(up.stop)
    gw = await start_gateway([up.url], prefix=EXACT)
    index = gw.state.prefix.exact.index
    await wait_for(lambda: index.live(up.name))
    ep = next(iter(gw.state.registry))
    await wait_for(lambda: ep.metrics.scraped_at > 0)
    assert ep.metrics.block_size is None  # garbage is "not reported" (it once made every request a 500)
    status, body = await chat(http, gw.url, "hello there " * 20, model="tiny")
    assert status == 200, body
