"""End-to-end tests of the replica simulator over real sockets."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from loadtest.harness.ports import free_port
from loadtest.simulator import SimConfig, running_simulator

MODEL = "sim-llama"
ROOT = Path(__file__).resolve().parents[2]


def cfg(**kw: Any) -> SimConfig:
    kw.setdefault("time_scale", 50.0)
    return SimConfig(port=0, **kw)


def toks(n: int, base: int = 1000) -> list[int]:
    return [base + i for i in range(n)]


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with s.post(url, json=body) as r:
        return r.status, await r.json()


async def completion(s: aiohttp.ClientSession, sim: Any, prompt: Any, max_tokens: int = 4) -> dict[str, Any]:
    status, body = await post(
        s, sim.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    )
    assert status == 200, body
    return body


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            bare = name.split("{")[0]  # samples of one metric are summed over their labels
            out[bare] = out.get(bare, 0.0) + float(value)
    return out


async def metrics(s: aiohttp.ClientSession, sim: Any) -> dict[str, float]:
    async with s.get(sim.url + "/metrics") as r:
        assert r.status == 200
        return parse_metrics(await r.text())


async def stream_ttft(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    t0 = time.monotonic()
    ttft = -1.0
    async with s.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {") and ttft < 0:
                ttft = time.monotonic() - t0
    return ttft


async def wait_for(pred: Any, limit: float = 3.0) -> None:
    deadline = time.monotonic() + limit
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# ---- prefix cache ---------------------------------------------------------------------


async def test_same_prompt_twice_hits_full_blocks() -> None:
    async with running_simulator(cfg()) as sim, aiohttp.ClientSession() as s:
        first = await completion(s, sim, toks(100))
        second = await completion(s, sim, toks(100))
        assert first["usage"]["prompt_tokens"] == 100
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        # A prompt that is an exact multiple of the block size keeps its last block to compute.
        await completion(s, sim, toks(64, base=5000))
        third = await completion(s, sim, toks(64, base=5000))
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        # Chat: conversations sharing leading messages share leading blocks.
        msgs = [{"role": "system", "content": "You are a careful assistant. " * 20}]
        body = {"model": MODEL, "max_tokens": 2}
        _, a = await post(
            s,
            sim.url + "/v1/chat/completions",
            {**body, "messages": [*msgs, {"role": "user", "content": "a"}]},
        )
        _, b = await post(
            s,
            sim.url + "/v1/chat/completions",
            {**body, "messages": [*msgs, {"role": "user", "content": [{"type": "text", "text": "b"}]}]},
        )
        pt = a["usage"]["prompt_tokens"]
        assert b["usage"]["prompt_tokens"] == pt
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == (pt - 6) // 16 * 16
        m = await metrics(s, sim)
        assert m["vllm:prefix_cache_hits_total"] == 96 + 48 + (pt - 6) // 16 * 16
        assert m["vllm:prefix_cache_queries_total"] == 100 * 2 + 64 * 2 + pt * 2


async def test_eviction_under_pressure_is_lru() -> None:
    async with running_simulator(cfg(kv_blocks=32, block_size=16)) as sim, aiohttp.ClientSession() as s:
        await completion(s, sim, toks(100))
        assert (await completion(s, sim, toks(100)))["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        for i in range(8):  # 8 distinct prompts x 7 blocks >> 32 blocks
            await completion(s, sim, toks(100, base=10_000 * (i + 2)))
        again = await completion(s, sim, toks(100))
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert sim.engine.kv.evictions > 0
        # The most recent prompt is still resident.
        recent = await completion(s, sim, toks(100, base=10_000 * 9))
        assert recent["usage"]["prompt_tokens_details"]["cached_tokens"] == 96


async def test_preemption_when_kv_exhausted_and_all_complete() -> None:
    async with (
        running_simulator(cfg(kv_blocks=20, block_size=16, max_num_seqs=8)) as sim,
        aiohttp.ClientSession() as s,
    ):
        res = await asyncio.gather(
            *(completion(s, sim, toks(32, base=1000 * i), max_tokens=64) for i in range(1, 7))
        )
        assert all(r["usage"]["completion_tokens"] == 64 for r in res)
        assert all(len(r["choices"][0]["text"].split()) == 64 for r in res)
        m = await metrics(s, sim)
        assert m["vllm:num_preemptions_total"] > 0
        assert m["vllm:request_success_total"] == 6  # summed over finished_reason; abort is 0
        assert sim.engine.kv.num_free == 20


async def test_metrics_move_with_load_and_return_to_idle() -> None:
    async with running_simulator(cfg(time_scale=10, max_num_seqs=2)) as sim, aiohttp.ClientSession() as s:
        tasks = [
            asyncio.create_task(completion(s, sim, toks(40, base=100 * i), max_tokens=60)) for i in range(6)
        ]
        seen_running = seen_waiting = seen_usage = 0.0
        while not all(t.done() for t in tasks):
            m = await metrics(s, sim)
            seen_running = max(seen_running, m["vllm:num_requests_running"])
            seen_waiting = max(seen_waiting, m["vllm:num_requests_waiting"])
            seen_usage = max(seen_usage, m["vllm:kv_cache_usage_perc"])
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        assert seen_running == 2
        assert seen_waiting >= 1
        assert 0 < seen_usage < 1
        m = await metrics(s, sim)
        assert m["vllm:num_requests_running"] == 0
        assert m["vllm:num_requests_waiting"] == 0
        assert m["vllm:kv_cache_usage_perc"] == 0
        assert m["vllm:time_to_first_token_seconds_count"] == 6
        assert m["vllm:cache_config_info"] == 1
        assert 'num_gpu_blocks="2048"' in await (await s.get(sim.url + "/metrics")).text()
        assert m["sim:step_wall_over_model_ratio"] > 0


async def test_sglang_metric_names() -> None:
    async with running_simulator(cfg(engine="sglang")) as sim, aiohttp.ClientSession() as s:
        await completion(s, sim, toks(50))
        await completion(s, sim, toks(50))
        m = await metrics(s, sim)
        assert m["sglang:num_queue_reqs"] == 0
        assert m["sglang:num_running_reqs"] == 0
        assert m["sglang:token_usage"] == 0
        assert m["sglang:cache_hit_rate"] == pytest.approx(48 / 100)
        assert not any(k.startswith("vllm:") for k in m)


# ---- disconnects and TTFT ---------------------------------------------------------------


async def test_disconnect_mid_stream_frees_blocks() -> None:
    async with running_simulator(cfg(time_scale=5)) as sim:
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": toks(200), "max_tokens": 2000, "stream": True}
            r = await s.post(sim.url + "/v1/completions", json=body)
            chunks = 0
            async for line in r.content:
                chunks += line.startswith(b"data: ")
                if chunks == 3:
                    break
            assert len(sim.engine.running) == 1
            assert sim.engine.kv.num_free < sim.engine.kv.num_blocks
            r.close()
        await wait_for(lambda: not sim.engine.running and sim.engine.kv.num_free == sim.engine.kv.num_blocks)
        assert sim.engine.kv.usage == 0
        assert sim.engine.finished["abort"] == 1
        assert sim.engine.finished["length"] == 0


async def test_disconnect_while_non_streaming_aborts() -> None:
    async with running_simulator(cfg(time_scale=5)) as sim:
        timeout = aiohttp.ClientTimeout(total=0.3)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            with pytest.raises(asyncio.TimeoutError):
                await s.post(
                    sim.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2000}
                )
        await wait_for(lambda: not sim.engine.running and sim.engine.kv.usage == 0)
        assert sim.engine.finished["abort"] == 1


async def test_ttft_grows_with_uncached_prompt_length() -> None:
    async with (
        running_simulator(cfg(time_scale=2, max_batched_tokens=8192)) as sim,
        aiohttp.ClientSession() as s,
    ):
        body = {"model": MODEL, "prompt": toks(4000), "max_tokens": 2}
        cold = await stream_ttft(s, sim.url, body)  # ~ (6 ms + 4000 x 25 us) / 2 = 53 ms
        warm = await stream_ttft(s, sim.url, body)  # 3984 tokens cached
        short = await stream_ttft(s, sim.url, {**body, "prompt": toks(20, base=90_000)})
        assert cold > 0.045
        assert warm < cold / 3
        assert short < cold / 3


async def test_ttft_grows_with_queue_depth() -> None:
    async with running_simulator(cfg(time_scale=10, max_num_seqs=1)) as sim, aiohttp.ClientSession() as s:
        bodies = [{"model": MODEL, "prompt": toks(16, base=100 * i), "max_tokens": 30} for i in range(4)]
        ttfts = await asyncio.gather(*(stream_ttft(s, sim.url, b) for b in bodies))
        ttfts.sort()
        # Each queued request waits for ~30 decode steps (~18 ms) of every request ahead of it.
        assert ttfts[-1] > ttfts[0] + 0.04
        assert ttfts[-1] > 3 * ttfts[0]


# ---- wire format ----------------------------------------------------------------------


def sse_events(raw: bytes) -> list[str]:
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: ") :] for e in events]


async def test_sse_chat_format_exact_with_usage() -> None:
    async with running_simulator(cfg()) as sim, aiohttp.ClientSession() as s:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello, world!"}], "max_tokens": 5}
        async with s.post(
            sim.url + "/v1/chat/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        ) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = sse_events(await r.read())
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len(chunks) == 1 + 5 + 1  # role, 5 tokens, usage
        assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("chatcmpl-")
        assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
        assert all(isinstance(c["created"], int) for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = chunks[1:6]
        assert [c["choices"][0]["finish_reason"] for c in content] == [None] * 4 + ["length"]
        assert all(c["choices"][0]["index"] == 0 for c in content)
        text = "".join(c["choices"][0]["delta"]["content"] for c in content)
        assert chunks[-1]["choices"] == []
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == 5 and usage["total_tokens"] == usage["prompt_tokens"] + 5
        assert usage["prompt_tokens"] == len(
            "<|start|> user Hello , world ! <|end|> <|start|> assistant".split()
        )
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": 0}  # < 1 block
        # Deterministic: the non-streaming answer is the same text.
        status, full = await post(s, sim.url + "/v1/chat/completions", body)
        assert status == 200 and full["object"] == "chat.completion"
        assert full["choices"][0]["message"] == {
            "role": "assistant",
            "content": text,
            **dict.fromkeys(("refusal", "annotations", "audio", "function_call", "reasoning")),
        }
        assert full["choices"][0]["finish_reason"] == "length"


async def test_sse_completions_without_usage() -> None:
    async with running_simulator(cfg()) as sim, aiohttp.ClientSession() as s:
        async with s.post(
            sim.url + "/v1/completions",
            json={"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True},
        ) as r:
            events = sse_events(await r.read())
        assert events[-1] == "[DONE]" and len(events) == 4
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(isinstance(c["choices"][0]["text"], str) and c["choices"][0]["text"] for c in chunks)


async def test_errors_models_and_health() -> None:
    async with running_simulator(cfg()) as sim, aiohttp.ClientSession() as s:
        status, body = await post(
            s,
            sim.url + "/v1/chat/completions",
            {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        )
        assert status == 404
        assert set(body["error"]) == {"message", "type", "code", "param"} and body["error"]["code"] == 404
        async with s.post(
            sim.url + "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}
        ) as r:
            assert r.status == 400
            assert "error" in await r.json()
        status, body = await post(s, sim.url + "/v1/chat/completions", {"model": MODEL, "messages": "hi"})
        assert status == 400 and body["error"]["param"] == "body.messages"
        status, body = await post(
            s, sim.url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**7}
        )
        assert status == 400
        async with s.get(sim.url + "/v1/models") as r:
            models = await r.json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
        async with s.get(sim.url + "/health") as r:
            assert r.status == 200


async def test_openai_client_chat_and_completions() -> None:
    async with running_simulator(cfg()) as sim:
        client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)
        try:
            msgs = [{"role": "user", "content": "tell me a story"}]
            chat = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=7)
            assert chat.usage.completion_tokens == 7
            text = chat.choices[0].message.content
            assert len(text.split()) == 7
            stream = await client.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=7, stream=True, stream_options={"include_usage": True}
            )
            parts, usage = [], None
            async for ch in stream:
                if ch.choices:
                    parts.append(ch.choices[0].delta.content or "")
                if ch.usage:
                    usage = ch.usage
            assert "".join(parts) == text
            assert usage is not None and usage.prompt_tokens_details.cached_tokens == 0  # 12 tokens < 1 block
            comp = await client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=5)
            assert comp.usage.completion_tokens == 5 and comp.choices[0].finish_reason == "length"
            cstream = await client.completions.create(
                model=MODEL, prompt="once upon a time", max_tokens=5, stream=True
            )
            ctext = "".join([c.choices[0].text async for c in cstream])
            assert ctext == comp.choices[0].text
            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="other", prompt="x", max_tokens=1)
        finally:
            await client.close()


# ---- faults -----------------------------------------------------------------------------


async def set_fault(s: aiohttp.ClientSession, sim: Any, **fault: Any) -> None:
    async with s.post(sim.url + "/admin/fault", json=fault) as r:
        assert r.status == 200


async def test_fault_error_hang_drop_slow() -> None:
    async with running_simulator(cfg(time_scale=20)) as sim, aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": "fault test", "max_tokens": 20}
        await set_fault(s, sim, mode="error", status=503)
        status, err = await post(s, sim.url + "/v1/completions", body)
        assert status == 503 and "error" in err
        # hang: accepted, never answered; nothing leaks once the client gives up
        await set_fault(s, sim, mode="hang")
        with pytest.raises(asyncio.TimeoutError):
            await s.post(sim.url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.3))
        assert not sim.engine.running and not sim.engine.waiting and sim.engine.finished["length"] == 0
        # drop: the stream is cut after exactly 3 chunks
        await set_fault(s, sim, mode="drop", after_chunks=3)
        got = 0
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.post(sim.url + "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.content:
                    got += line.startswith(b"data: ")
        assert got == 3
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await post(s, sim.url + "/v1/completions", body)
        await wait_for(lambda: not sim.engine.running and sim.engine.kv.usage == 0)
        # slow: steps take slow_factor times longer
        await set_fault(s, sim, mode="none")
        m0 = sim.engine.stats.model_s
        await post(s, sim.url + "/v1/completions", body)
        normal = sim.engine.stats.model_s - m0
        await set_fault(s, sim, mode="slow", slow_factor=8)
        m0, t0 = sim.engine.stats.model_s, time.monotonic()
        status, _ = await post(s, sim.url + "/v1/completions", body)
        slow_model, slow_wall = sim.engine.stats.model_s - m0, time.monotonic() - t0
        assert status == 200
        assert slow_model == pytest.approx(8 * normal, rel=0.01)
        # ~20 steps x 8 x 0.3 ms really slept (the engine shortens sleeps to repay earlier
        # overruns, so wall time may fall a little short of the model; without the sleeps
        # it would be near zero)
        assert slow_wall >= 0.5 * slow_model
        await set_fault(s, sim, mode="none")
        async with s.get(sim.url + "/admin/state") as r:
            state = await r.json()
        assert state["fault"]["mode"] == "none" and state["running"] == 0 and state["slow_factor"] == 1.0


# ---- prefill / decode disaggregation ------------------------------------------------------


async def test_vllm_nixl_pd_honoured_and_misuse_recomputed() -> None:
    async with (
        running_simulator(cfg(role="prefill")) as pre,
        running_simulator(cfg(role="decode")) as dec,
        aiohttp.ClientSession() as s,
    ):
        prompt = toks(300)
        status, p = await post(
            s,
            pre.url + "/v1/completions",
            {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
            },
        )
        assert status == 200
        kvp = p["kv_transfer_params"]
        assert kvp["do_remote_prefill"] is True and kvp["do_remote_decode"] is False
        assert kvp["remote_port"] == pre.config.port and kvp["remote_host"] == "127.0.0.1"
        assert len(kvp["remote_block_ids"]) == -(-301 // 16)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "kv_transfer_params": kvp}
        status, d = await post(s, dec.url + "/v1/completions", body)
        assert status == 200 and d["usage"]["prompt_tokens_details"]["cached_tokens"] == 299
        assert d.get("kv_transfer_params") is None
        # Replaying consumed params, or naming an unknown engine, forces a recompute.
        status, d2 = await post(s, dec.url + "/v1/completions", {**body, "prompt": toks(300, base=7000)})
        bogus = {**kvp, "remote_engine_id": "nope"}
        status, d3 = await post(s, dec.url + "/v1/completions", {**body, "kv_transfer_params": bogus})
        assert d2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert d3["usage"]["prompt_tokens_details"]["cached_tokens"] == 288  # local prefix cache only
        m = await metrics(s, dec)
        text = await (await s.get(dec.url + "/metrics")).text()
        assert 'sim:pd_transfers_total{engine="0",model_name="sim-llama",outcome="honoured"} 1.0' in text
        assert 'sim:pd_transfers_total{engine="0",model_name="sim-llama",outcome="recomputed"} 2.0' in text
        assert m["vllm:prefix_cache_queries_total"] > 0


async def test_sglang_bootstrap_room_pd() -> None:
    async with (
        running_simulator(cfg(engine="sglang", role="prefill")) as pre,
        running_simulator(cfg(engine="sglang", role="decode")) as dec,
        aiohttp.ClientSession() as s,
    ):
        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pre.config.port, "bootstrap_room": 12345}
        body = {"model": MODEL, "prompt": toks(200), "max_tokens": 4, **boot}
        (_, d), (_, p) = await asyncio.gather(
            post(s, dec.url + "/v1/completions", body),
            post(s, pre.url + "/v1/completions", {**body, "max_tokens": 1}),
        )
        assert p["usage"]["completion_tokens"] == 1
        assert d["usage"]["completion_tokens"] == 4
        assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == 199
        # No prefill ever arrives for this room: decode waits, then recomputes.
        status, d2 = await post(
            s, dec.url + "/v1/completions", {**body, "prompt": toks(200, 50_000), "bootstrap_room": 999}
        )
        assert status == 200 and d2["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        async with s.get(dec.url + "/admin/state") as r:
            assert (await r.json())["pd_transfers"] == {"honoured": 1, "recomputed": 1}


# ---- CLI ---------------------------------------------------------------------------------


async def _wait_healthy(s: aiohttp.ClientSession, url: str, proc: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        assert proc.returncode is None, "simulator exited early"
        try:
            async with s.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url} never became healthy")


async def test_cli_replicas_supervised_and_stopped_by_sigterm() -> None:
    base = free_port()
    # Two consecutive ports are needed; retry if the neighbour is taken.
    while True:
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", base + 1))
            break
        except OSError:
            base = free_port()
    cmd = [
        sys.executable,
        "-m",
        "loadtest.simulator",
        "--replicas",
        "2",
        "--base-port",
        str(base),
        "--time-scale",
        "50",
    ]
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(2):
                url = f"http://127.0.0.1:{base + i}"
                await _wait_healthy(s, url, proc)
                status, body = await post(
                    s, url + "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3}
                )
                assert status == 200 and body["usage"]["completion_tokens"] == 3
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
            with pytest.raises(aiohttp.ClientConnectionError):
                await s.get(f"http://127.0.0.1:{base}/health")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_port_taken_between_choosing_and_binding_is_chosen_again(monkeypatch):
    """The simulator picks a free port, then binds it; another process can take it in between
    (a CI run failed so). Here a real socket holds the first port picked."""
    import loadtest.simulator.server as sim_server
    from loadtest.simulator.config import SimConfig
    from loadtest.simulator.server import running_simulator

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    picks = iter([busy])
    real = sim_server.free_port
    monkeypatch.setattr(sim_server, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
    try:
        async with running_simulator(SimConfig(port=0, model="m")) as sim:
            assert sim.config.port != busy
            async with aiohttp.ClientSession() as http, http.get(sim.url + "/health") as resp:
                assert resp.status == 200
    finally:
        taken.close()
