"""Prefill and decode simulators in SEPARATE processes: KV transfers are claimed over HTTP from the
prefill replica the params name (vLLM: remote_host/remote_port; SGLang: bootstrap_host/bootstrap_port)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.proxy.pd.helpers import MODEL, PROTOCOLS, long_prompt, stop_process
from tests.support.harness import free_port, metric_value

ROOT = Path(__file__).resolve().parents[3]


@contextlib.asynccontextmanager
async def sim_process(http: aiohttp.ClientSession, engine: str, role: str) -> AsyncIterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "loadtest.simulator", "--port", str(port),
           "--engine", engine, "--role", role, "--time-scale", "50"]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=asyncio.subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(150):
            assert proc.returncode is None, "simulator exited"
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url + "/health") as r:
                    if r.status == 200:
                        break
            await asyncio.sleep(0.1)
        yield url
    finally:
        await stop_process(proc)


async def transfers(http: aiohttp.ClientSession, url: str) -> dict[str, int]:
    async with http.get(url + "/admin/state") as r:
        return (await r.json())["pd_transfers"]


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_vllm_claim_across_processes_is_one_shot(http) -> None:
    async with sim_process(http, "vllm", "prefill") as pre, sim_process(http, "vllm", "decode") as dec:
        prompt = list(range(1000, 1400))
        p = await post(
            http,
            pre,
            {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        )
        kvp = p["kv_transfer_params"]
        assert f"http://{kvp['remote_host']}:{kvp['remote_port']}" == pre  # the prefill names itself
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "kv_transfer_params": kvp}
        d = await post(http, dec, body)
        assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == 399
        # A replayed claim (new prompt so the local prefix cache cannot help) is recomputed.
        d2 = await post(http, dec, {**body, "prompt": list(range(5000, 5400))})
        assert d2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # The wrong prompt for live params: recomputed.
        p = await post(
            http,
            pre,
            {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        )
        await post(
            http,
            dec,
            {**body, "prompt": list(range(7000, 7400)), "kv_transfer_params": p["kv_transfer_params"]},
        )
        assert await transfers(http, dec) == {"honoured": 1, "recomputed": 2}


async def test_sglang_bootstrap_across_processes(http) -> None:
    async with sim_process(http, "sglang", "prefill") as pre, sim_process(http, "sglang", "decode") as dec:
        port = int(pre.rsplit(":", 1)[1])
        body = {"model": MODEL, "prompt": list(range(1000, 1300)), "max_tokens": 3}
        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 4242}
        # The decode replica arrives first and long-polls the prefill replica's bootstrap server.
        d_task = asyncio.create_task(post(http, dec, {**body, **boot}))
        await asyncio.sleep(0.05)
        await post(http, pre, {**body, **boot, "max_tokens": 1})
        d = await d_task
        assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == 299
        # The room was consumed: the same room again is recomputed after the bounded wait.
        d2 = await post(http, dec, {**body, "prompt": list(range(6000, 6300)), **boot})
        assert d2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert await transfers(http, dec) == {"honoured": 1, "recomputed": 1}


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_gateway_with_separate_process_sims(protocol, http, start_gateway) -> None:
    async with sim_process(http, protocol, "prefill") as pre, sim_process(http, protocol, "decode") as dec:
        prefill = {"url": pre, "role": "prefill", "engine": protocol}
        if protocol == "sglang":
            prefill["bootstrap_port"] = int(pre.rsplit(":", 1)[1])
        gw = await start_gateway(
            [prefill, {"url": dec, "role": "decode", "engine": protocol}],
            pd={"protocol": protocol, "decider": "always"},
        )
        for i in range(3):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": long_prompt(tag=f"p{i}")}],
                "max_tokens": 4,
                "stream": i == 2,
                **({"stream_options": {"include_usage": True}} if i == 2 else {}),
            }
            async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
        assert await transfers(http, dec) == {"honoured": 3, "recomputed": 0}
        async with http.get(dec + "/metrics") as r:
            assert metric_value(await r.text(), "sim:pd_transfers_total", outcome="honoured") == 3
        async with http.get(gw.url + "/metrics") as r:
            assert (metric_value(await r.text(), "llm_gateway_pd_degraded_total") or 0) == 0
