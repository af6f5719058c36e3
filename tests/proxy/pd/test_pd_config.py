"""P/D configuration: validation errors name the key; the CLI quick flags build a working P/D gateway."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from gateway.cli import _serve_overrides, build_parser
from gateway.config import ConfigError, load_config
from tests.proxy.pd.helpers import MODEL, endpoints, finished, gw_metric, long_prompt, pd_counts, stop_process
from tests.support.harness import free_port

REPO = Path(__file__).resolve().parents[3]

ROOT = Path(__file__).resolve().parents[3]


def test_sglang_prefill_without_bootstrap_port_is_rejected() -> None:
    raw = {
        "endpoints": [
            {"url": "http://127.0.0.1:9001", "role": "decode"},
            {"url": "http://127.0.0.1:9002", "role": "prefill"},
        ],
        "pd": {"protocol": "sglang"},
    }
    with pytest.raises(ConfigError, match=r"endpoints\.1\.bootstrap_port"):
        load_config(overrides=raw, environ={})
    raw["endpoints"][1]["bootstrap_port"] = 8998
    assert load_config(overrides=raw, environ={}).endpoints[1].bootstrap_port == 8998


def test_prefill_without_decode_is_rejected() -> None:
    raw = {"endpoints": [{"url": "http://127.0.0.1:9002", "role": "prefill"}]}
    with pytest.raises(ConfigError, match="decode"):
        load_config(overrides=raw, environ={})


def test_cli_quick_flags_build_pd_config() -> None:
    args = build_parser().parse_args(
        ["serve", "--prefill", "http://127.0.0.1:9001", "--decode", "http://127.0.0.1:9002"]
    )
    config = load_config(overrides=_serve_overrides(args), environ={})
    assert [(e.url, e.role) for e in config.endpoints] == [
        ("http://127.0.0.1:9001", "prefill"),
        ("http://127.0.0.1:9002", "decode"),
    ]
    assert config.pd.protocol == "vllm" and config.policy is None  # the P/D preset applies


def test_cli_quick_flags_sglang() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--prefill",
            "http://127.0.0.1:9001",
            "--decode",
            "http://127.0.0.1:9002",
            "--pd-protocol",
            "sglang",
        ]
    )
    config = load_config(overrides=_serve_overrides(args), environ={})
    assert config.pd.protocol == "sglang"
    assert [e.bootstrap_port for e in config.endpoints if e.role == "prefill"] == [8998]


async def test_cli_serve_quick_flags_subprocess(start_sim, http: aiohttp.ClientSession) -> None:
    """`llm-gateway serve --prefill URL --decode URL` in its own process, in front of real simulators."""
    prefill = await start_sim(role="prefill")
    decode = await start_sim(role="decode")
    port = free_port()
    cmd = [
        sys.executable, "-c", "import sys; from gateway.cli import main; sys.exit(main())",
        "serve", "--prefill", prefill.url, "--decode", decode.url,
        "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(150):  # up to ~15 s for the interpreter to start and endpoints to come up
            assert proc.returncode is None, "gateway exited"
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url + "/v1/models") as r:
                    if r.status == 200 and (await r.json())["data"]:
                        break
            await asyncio.sleep(0.1)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": long_prompt(tag="q")}],
            "max_tokens": 3,
        }
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            usage = (await r.json())["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
        assert pd_counts(decode) == (1, 0)
    finally:
        await stop_process(proc)


async def test_the_shipped_pd_example_disaggregates(start_sim, start_gateway, http) -> None:
    """deploy/k8s/examples/vllm-pd/gateway.yml: its own plugins replace every preset. They were
    one profile without role filters or pd-disagg: nothing was disaggregated and the prefill
    replicas got whole client requests."""
    example = yaml.safe_load((REPO / "deploy/k8s/examples/vllm-pd/gateway.yml").read_text())
    routing = {key: example[key] for key in ("pd", "plugins", "profiles")}
    routing["pd"] = {**routing["pd"], "decider": "always"}
    routing["plugins"] = [
        {**p, "parameters": {**p["parameters"], "decider": "always"}} if p["type"] == "pd-disagg" else p
        for p in routing["plugins"]
    ]
    prefill = await start_sim(engine="vllm", role="prefill")
    decode = await start_sim(engine="vllm", role="decode")
    gw = await start_gateway(endpoints("vllm", [prefill], [decode]), **routing)
    body = {"model": MODEL, "messages": [{"role": "user", "content": long_prompt()}], "max_tokens": 4}
    for _ in range(3):
        async with http.post(gw.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
    assert pd_counts(decode) == (3, 0)  # every decode came with its prefill's KV
    assert finished(prefill) == 3  # the prefill replica ran prefill legs only (max_tokens 1)
    assert await gw_metric(http, gw, "llm_gateway_pd_decisions_total", mode="disaggregated") == 3
