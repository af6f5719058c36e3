"""A reload that rotates an https endpoint's CA (same URL) reaches inference connections: the
pool built with the old SSL context is retired (found by review, 2026-12-05: health checks went
green while every request got 502)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
from pathlib import Path

import pytest

from gateway.config import EndpointConfig
from gateway.http.reload import apply_config
from tests.fleet.servers import Engine, running_engine, self_signed
from tests.support.harness import chat_body, wait_until


async def _chat(http, gw) -> tuple[int, str]:
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body()) as resp:
        return resp.status, (await resp.read()).decode()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a test CA")
async def test_reloaded_tls_ca_reaches_inference_connections(
    tmp_path: Path, stack: contextlib.AsyncExitStack, start_gateway, http
):
    cert_a, key_a = self_signed(tmp_path, "engine-a")
    cert_b, key_b = self_signed(tmp_path, "engine-b")
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert_a, key_a)
    engine = await stack.enter_async_context(running_engine(Engine(), ssl_context=tls))
    gw = await start_gateway([{"url": engine.url, "tls_ca_file": str(cert_a)}])
    state = gw.state
    assert all(e.healthy for e in state.registry)
    assert (await _chat(http, gw))[0] == 200  # the inference pool now exists, with CA A

    # The CA rotation: the engine presents a certificate from CA B, the config names CA B.
    tls.load_cert_chain(cert_b, key_b)
    rotated = EndpointConfig(url=engine.url, tls_ca_file=str(cert_b))
    await apply_config(state, state.config.model_copy(update={"endpoints": [rotated]}))
    await wait_until(
        lambda: asyncio.sleep(0, state.registry.get(engine.url).healthy), 3.0, "the probe with CA B"
    )
    # Several at once: the one idle keep-alive connection made under CA A cannot carry them all,
    # so new connections are opened — and must be verified with CA B.
    results = await asyncio.gather(*(_chat(http, gw) for _ in range(4)))
    assert [status for status, _ in results] == [200] * 4, results
