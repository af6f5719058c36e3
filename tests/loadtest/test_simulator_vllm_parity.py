"""The simulator against real vLLM 0.32: same requests, answers compared with the captured ones.

The reference is what vLLM 0.32 (CPU build) really answered, kept in tests/e2e_vllm/captures
(made by loadtest/realvllm/capture.py) and tests/data. The simulator runs configured as that
replica was (model tiny-llama, --block-size 32, 128 KV blocks, --max-model-len 2048) and gets
the very same probe bodies over a real socket.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.fleet.endpoint import EngineKind
from gateway.fleet.scraper import parse_engine_metrics
from loadtest.realvllm.capture import PROBES
from loadtest.simulator import SimConfig, running_simulator

ROOT = Path(__file__).resolve().parents[2]
CAPTURES = ROOT / "tests" / "e2e_vllm" / "captures"
SAMPLE = ROOT / "tests" / "data" / "vllm-0.32-cpu-metrics-sample.txt"
MODEL = "tiny-llama"


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: str


def load_probes(path: Path) -> dict[str, Answer]:
    """Parse a probes.*.txt capture: ``### name: ...`` / ``HTTP status`` / headers / blank / body."""
    out: dict[str, Answer] = {}
    for section in path.read_text().split("\n### "):
        head, _, rest = section.removeprefix("### ").partition("\n")
        status_line, _, rest = rest.partition("\n")
        header_text, _, body = rest.partition("\n\n")
        headers = dict(line.split(": ", 1) for line in header_text.splitlines() if ": " in line)
        out[head.split(":", 1)[0]] = Answer(int(status_line.split()[1]), headers, body.strip())
    return out


VLLM = load_probes(CAPTURES / "probes.vllm.txt")


def sim_config(**kw: Any) -> SimConfig:
    base: dict[str, Any] = dict(
        port=0, model=MODEL, block_size=32, kv_blocks=128, max_model_len=2048, time_scale=50.0
    )
    return SimConfig(**{**base, **kw})


async def ask(s: aiohttp.ClientSession, url: str, probe: str) -> Answer:
    """Send capture probe `probe` exactly as capture.py sent it."""
    method, path, body = PROBES[probe]
    kwargs: dict[str, Any] = {}
    if isinstance(body, bytes):
        kwargs = {"data": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kwargs = {"json": {"model": MODEL, **body}}
    async with s.request(method, url + path, **kwargs) as r:
        return Answer(r.status, dict(r.headers), (await r.read()).decode())


def shape(obj: Any) -> Any:
    """Keys in order and value kinds, recursively: what a client parsing the body relies on."""
    if isinstance(obj, dict):
        return [(k, shape(v)) for k, v in obj.items()]
    if isinstance(obj, list):
        return [shape(v) for v in obj]
    if obj is None or isinstance(obj, bool):
        return obj if obj is None else "bool"
    return "num" if isinstance(obj, int | float) else "str"


def sse(body: str) -> list[Any]:
    events = [e.removeprefix("data: ") for e in body.strip().split("\n\n")]
    assert events[-1] == "[DONE]", events[-1]
    return [json.loads(e) for e in events[:-1]]


def cache_config_labels(text: str) -> dict[str, str]:
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            (sample,) = family.samples
            return dict(sample.labels)
    raise AssertionError("no vllm:cache_config_info")


def success_series(text: str) -> list[tuple[str, float]]:
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:request_success":
            return [
                (s.labels["finished_reason"], s.value) for s in family.samples if s.name.endswith("_total")
            ]
    raise AssertionError("no vllm:request_success")


# ---- 1. cache_config_info ------------------------------------------------------------------


async def test_cache_config_info_carries_vllms_labels_and_no_model_name() -> None:
    real = cache_config_labels((CAPTURES / "metrics-idle.vllm.txt").read_text())
    sample = cache_config_labels(SAMPLE.read_text())
    async with running_simulator(sim_config()) as sim, aiohttp.ClientSession() as s:
        async with s.get(sim.url + "/metrics") as r:
            text = await r.text()
    ours = cache_config_labels(text)
    assert "model_name" not in ours and ours["engine"] == "0"
    assert list(ours) == sorted(sample) == sorted(real)
    # Same configuration as the captured replica: same values, except the KV memory size, which
    # vLLM only knows on CPU (VLLM_CPU_KVCACHE_SPACE); a GPU replica, as simulated, reports None.
    differ = {k for k in real if real[k] != ours[k]}
    assert differ == {"kv_cache_memory_bytes"} and ours["kv_cache_memory_bytes"] == "None"
    assert ours["kv_cache_size_tokens"] == "4096" and ours["kv_cache_max_concurrency"] == "2.0"
    # The gateway still learns the engine's KV size from it.
    load = parse_engine_metrics(text, EngineKind.VLLM)
    assert (load.block_size, load.num_blocks) == (32, 128)


# ---- 2. request_success on a client disconnect ------------------------------------------------


async def test_client_disconnect_is_not_counted_as_a_success_abort() -> None:
    real = [
        (m.group(1), float(m.group(2)))
        for m in re.finditer(
            r'finished_reason="(\w+)".*\} (\S+)', (CAPTURES / "disconnect.vllm.txt").read_text()
        )
    ]
    assert dict(real)["abort"] == 0
    async with running_simulator(sim_config(time_scale=5)) as sim, aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": "x " * 50, "max_tokens": 1500, "stream": True}
        r = await s.post(sim.url + "/v1/completions", json=body)
        seen = 0
        async for line in r.content:
            seen += line.startswith(b"data: ")
            if seen == 5:
                break
        r.close()
        deadline = time.monotonic() + 5
        while sim.engine.running:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await ask(s, sim.url, "completion")  # one that finishes normally
        async with s.get(sim.url + "/metrics") as m:
            ours = success_series(await m.text())
    assert [reason for reason, _ in ours] == [reason for reason, _ in real]  # all five, vLLM's order
    assert dict(ours) == {"stop": 0, "length": 1, "abort": 0, "error": 0, "repetition": 0}
    assert sim.engine.finished["abort"] == 1  # the admin view still shows the aborted request


# ---- 3. priority without priority scheduling ---------------------------------------------------


async def test_priority_is_accepted_and_ignored_without_priority_scheduling() -> None:
    assert VLLM["priority-without-priority-scheduling"].status == 200
    async with running_simulator(sim_config()) as sim, aiohttp.ClientSession() as s:
        got = await ask(s, sim.url, "priority-without-priority-scheduling")
        assert got.status == 200, got.body
        assert json.loads(got.body)["choices"][0]["finish_reason"] == "length"
        bad = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "priority": "high"}
        async with s.post(sim.url + "/v1/completions", json=bad) as r:
            err = (await r.json())["error"]
        assert r.status == 400 and err["type"] == "Bad Request" and err["param"] == "body.priority"


# ---- 4. /v1/models ---------------------------------------------------------------------------


async def test_models_card_reports_max_model_len_now_and_permissions() -> None:
    real = json.loads(VLLM["models"].body)
    async with running_simulator(sim_config()) as sim, aiohttp.ClientSession() as s:
        got = await ask(s, sim.url, "models")
        ours = json.loads(got.body)
        assert shape(ours) == shape(real)
        (card,) = ours["data"]
        assert card["max_model_len"] == 2048 == real["data"][0]["max_model_len"]
        assert abs(card["created"] - time.time()) < 5
        assert card["root"] == MODEL and card["owned_by"] == "vllm"
        assert re.fullmatch(r"modelperm-[0-9a-f]{16}", card["permission"][0]["id"])
        perm = {k: v for k, v in card["permission"][0].items() if k not in ("id", "created")}
        assert perm == {
            k: v for k, v in real["data"][0]["permission"][0].items() if k not in ("id", "created")
        }
    async with running_simulator(sim_config(max_model_len=4096)) as sim, aiohttp.ClientSession() as s:
        async with s.get(sim.url + "/v1/models") as r:
            assert (await r.json())["data"][0]["max_model_len"] == 4096  # not blocks x block size


# ---- 5 and 8. length limits and error bodies ----------------------------------------------------

ERROR_PROBES = (
    "err-unknown-model",
    "err-bad-json",
    "err-missing-messages",
    "err-max-tokens-negative",
    "err-max-tokens-over-model-len",
    "err-prompt-too-long",
    "err-empty-prompt",
)


async def test_error_bodies_are_byte_identical_to_vllms() -> None:
    async with running_simulator(sim_config()) as sim, aiohttp.ClientSession() as s:
        for probe in ERROR_PROBES:
            got = await ask(s, sim.url, probe)
            real = VLLM[probe]
            assert (got.status, got.body) == (real.status, real.body), probe
            assert got.headers["Content-Type"] == real.headers["Content-Type"] == "application/json"
            assert list(json.loads(got.body)["error"]) == ["message", "type", "param", "code"]


async def test_prompt_plus_max_tokens_over_the_limit_is_clamped() -> None:
    real = json.loads(VLLM["max-tokens-clamped"].body)["usage"]
    assert real["prompt_tokens"] + real["completion_tokens"] == 2048  # vLLM fills the context exactly
    async with running_simulator(sim_config(time_scale=200)) as sim, aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": list(range(1, 2001)), "max_tokens": 2000}
        async with s.post(sim.url + "/v1/completions", json=body) as r:
            ours = await r.json()
        assert r.status == 200
        assert ours["usage"]["completion_tokens"] == 48 == real["completion_tokens"]
        assert ours["choices"][0]["finish_reason"] == "length"
        # A prompt that fills the context leaves nothing to generate: vLLM's max_tokens check.
        async with s.post(
            sim.url + "/v1/completions", json={**body, "prompt": list(range(1, 2049)), "max_tokens": 5}
        ) as r:
            err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == "max_tokens" and "got 0" in err["message"]


# ---- 6. wire format ------------------------------------------------------------------------------


async def test_full_bodies_have_vllms_fields_in_vllms_order() -> None:
    async with running_simulator(sim_config()) as sim, aiohttp.ClientSession() as s:
        for probe, prefix in (("chat", "chatcmpl"), ("completion", "cmpl")):
            got = await ask(s, sim.url, probe)
            ours, real = json.loads(got.body), json.loads(VLLM[probe].body)
            assert shape(ours) == shape(real), probe
            assert re.fullmatch(prefix + r"-[0-9a-f]{16}", ours["id"])
            assert re.fullmatch(r"vllm-0\.32\.0-[0-9a-f]{8}", ours["system_fingerprint"])


async def test_streams_have_vllms_headers_and_chunk_fields() -> None:
    async with running_simulator(sim_config()) as sim, aiohttp.ClientSession() as s:
        for probe in ("chat-stream-usage", "chat-stream", "completion-stream-usage"):
            got, real = await ask(s, sim.url, probe), VLLM[probe]
            assert (
                got.headers["Content-Type"]
                == real.headers["Content-Type"]
                == "text/event-stream; charset=utf-8"
            )
            assert "Cache-Control" not in got.headers and "Cache-Control" not in real.headers
            ours, theirs = sse(got.body), sse(real.body)
            assert [shape(c) for c in ours] == [shape(c) for c in theirs], probe
            assert len({c["id"] for c in ours}) == 1 and re.fullmatch(r"c\w+-[0-9a-f]{16}", ours[0]["id"])
            # system_fingerprint rides on the last chunk only, as in vLLM
            assert [("system_fingerprint" in c) for c in ours] == [False] * (len(ours) - 1) + [True]


async def test_created_cache_tokens_counts_blocks_newly_cached_by_the_prompt() -> None:
    async with running_simulator(sim_config()) as sim, aiohttp.ClientSession() as s:
        usage = {}
        for probe in ("chat-cached-1st", "chat-cached-2nd", "cached-1st", "cached-2nd"):
            got = await ask(s, sim.url, probe)
            usage[probe] = json.loads(got.body)["usage"]
            ours_d, real_d = usage[probe]["prompt_tokens_details"], json.loads(VLLM[probe].body)["usage"]
            assert shape(ours_d) == shape(real_d["prompt_tokens_details"]), probe
    first, second = usage["chat-cached-1st"], usage["chat-cached-2nd"]
    full_blocks = first["prompt_tokens"] // 32 * 32
    # vLLM: 1st cached 0 / created 288 (9 full blocks of a 313-token prompt); 2nd cached 288 / created 0
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["prompt_tokens_details"]["created_cache_tokens"] == full_blocks > 0
    assert second["prompt_tokens_details"]["cached_tokens"] == full_blocks
    assert second["prompt_tokens_details"]["created_cache_tokens"] == 0
    assert usage["cached-1st"]["prompt_tokens_details"]["created_cache_tokens"] is None  # completions: null


# ---- 7. SIGTERM with requests in flight ----------------------------------------------------------


async def _start_cli(*extra: str) -> tuple[asyncio.subprocess.Process, str]:
    cmd = [sys.executable, "-m", "loadtest.simulator", "--port", "0", "--model", MODEL, *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        *cmd, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 15)
    assert line.startswith(b"sim replica ready "), line
    return proc, line.decode().split()[-1]


async def _in_flight(s: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[Any, Any]:
    """One non-streamed and one streamed completion, like the vLLM probe."""
    body = {"model": MODEL, "prompt": "x " * 20, "max_tokens": max_tokens}

    async def full() -> tuple[int, Any]:
        async with s.post(url + "/v1/completions", json=body) as r:
            return r.status, await r.json()

    async def streamed() -> tuple[int, list[Any]]:
        opts = {"stream": True, "stream_options": {"include_usage": True}}
        async with s.post(url + "/v1/completions", json={**body, **opts}) as r:
            return r.status, sse((await r.read()).decode())

    tasks = asyncio.create_task(full()), asyncio.create_task(streamed())
    deadline = time.monotonic() + 10
    while True:  # both admitted and decoding before the signal
        async with s.get(url + "/admin/state") as r:
            state = await r.json()
        if state["running"] == 2 and state["steps"] > 5:
            return tasks
        assert time.monotonic() < deadline, state
        await asyncio.sleep(0.05)


async def test_sigterm_refuses_new_connections_and_aborts_in_flight_requests() -> None:
    proc, url = await _start_cli()  # real time: 1900 tokens would take ~12 s
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            full, streamed = await _in_flight(s, url, 1900)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            status, body = await full
            assert status == 200 and body["choices"][0]["finish_reason"] == "abort"
            assert 0 < body["usage"]["completion_tokens"] < 1900
            status, chunks = await streamed
            assert status == 200
            assert chunks[-2]["choices"][0]["finish_reason"] == "abort" and chunks[-1]["choices"] == []
            assert 0 < chunks[-1]["usage"]["completion_tokens"] < 1900
            assert time.monotonic() - t0 < 3
            with pytest.raises(aiohttp.ClientConnectionError):  # the listening socket is gone
                async with aiohttp.ClientSession() as fresh:
                    await fresh.get(url + "/health")
        assert await asyncio.wait_for(proc.wait(), 5) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigterm_with_shutdown_timeout_lets_short_requests_finish() -> None:
    proc, url = await _start_cli("--shutdown-timeout", "10")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            full, streamed = await _in_flight(s, url, 150)  # ~1 s of decoding
            proc.send_signal(signal.SIGTERM)
            status, body = await full
            assert status == 200 and body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == 150
            status, chunks = await streamed
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert await asyncio.wait_for(proc.wait(), 5) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
