"""Endpoint URLs are honoured in full by inference, not only by health checks.

Regressions: ``https://`` endpoints passed their (aiohttp) health checks and then every
inference request failed, because the hot-path client spoke plain HTTP only; a path
prefix (``http://host/pfx``) was dropped from inference requests (404 while healthy);
probes and model discovery went without the endpoint's API key (401, never healthy);
``http://user:pw@host`` put the credentials in ``x-gateway-endpoint``, metric labels,
logs and the ``Host`` header instead of sending them as Basic auth.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import shutil
import ssl
from pathlib import Path

import pytest

from tests.fleet.servers import Engine, running_engine, self_signed
from tests.support.harness import chat_body, gateway_metrics
from tests.web.test_admin import ADMIN, AUTH


async def _chat(http, gw, stream: bool = False) -> tuple[int, str, str | None]:
    async with http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=stream)) as resp:
        return resp.status, (await resp.read()).decode(), resp.headers.get("x-gateway-endpoint")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a test CA")
async def test_https_endpoint_serves_inference_with_its_ca(
    tmp_path: Path, stack: contextlib.AsyncExitStack, start_gateway, http
):
    cert, key = self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    engine = await stack.enter_async_context(running_engine(Engine(), ssl_context=tls))
    assert engine.url.startswith("https://")

    gw = await start_gateway([{"url": engine.url, "tls_ca_file": str(cert)}])
    assert all(e.healthy for e in gw.state.registry)
    status, body, served_by = await _chat(http, gw)
    assert status == 200, body
    assert "hi there" in body and served_by == engine.name
    status, body, _ = await _chat(http, gw, stream=True)
    assert status == 200 and body.endswith("data: [DONE]\n\n") and "error" not in body

    # Verified by default: without that CA the certificate is not trusted, by probes or inference.
    before = len(engine.seen)
    untrusting = await start_gateway([{"url": engine.url, "models": ["tiny"]}])
    assert not any(e.healthy for e in untrusting.state.registry)
    untrusting.state.registry.get(engine.url).healthy = True  # force a send: the handshake must fail
    untrusting.state.registry.rebuild()
    status, _, _ = await _chat(http, untrusting)
    assert status in (502, 503)
    assert len(engine.seen) == before  # no request ever reached the application


async def test_path_prefix_is_kept_on_inference_requests(
    stack: contextlib.AsyncExitStack, start_gateway, http
):
    engine = await stack.enter_async_context(running_engine(Engine(prefix="/pfx")))
    gw = await start_gateway([engine.url])
    assert all(e.healthy for e in gw.state.registry)
    for stream in (False, True):
        status, body, _ = await _chat(http, gw, stream=stream)
        assert status == 200, body
    posts = [s.path for s in engine.seen if s.method == "POST"]
    assert posts == ["/pfx/v1/chat/completions"] * 2


async def test_api_key_is_sent_on_health_checks_and_model_discovery(
    stack: contextlib.AsyncExitStack, start_gateway, http
):
    engine = await stack.enter_async_context(running_engine(Engine(required_auth="Bearer engine-key")))
    gw = await start_gateway([{"url": engine.url, "api_key": "engine-key"}])  # models discovered
    endpoint = next(iter(gw.state.registry))
    assert endpoint.healthy and endpoint.models == {"tiny"}
    status, body, _ = await _chat(http, gw)
    assert status == 200, body
    paths = {s.path for s in engine.seen}
    assert {"/health", "/v1/models", "/v1/chat/completions"} <= paths
    assert all(s.headers.get("authorization") == "Bearer engine-key" for s in engine.seen)


async def test_user_info_is_sent_as_basic_auth_and_never_shown(
    stack: contextlib.AsyncExitStack, start_gateway, http, caplog
):
    caplog.set_level(logging.DEBUG)
    basic = "Basic " + base64.b64encode(b"alice:s3cr3t-pw").decode()
    engine = await stack.enter_async_context(running_engine(Engine(required_auth=basic)))
    url = engine.url.replace("http://", "http://alice:s3cr3t-pw@")
    gw = await start_gateway([url], auth=AUTH)
    endpoint = next(iter(gw.state.registry))
    assert endpoint.name == engine.name and endpoint.healthy

    status, body, served_by = await _chat(http, gw)
    assert status == 200, body
    assert served_by == engine.name
    status, body, _ = await _chat(http, gw, stream=True)
    assert status == 200 and body.endswith("data: [DONE]\n\n")
    assert {s.headers.get("authorization") for s in engine.seen} == {basic}
    assert {s.headers["host"] for s in engine.seen} == {engine.name}

    shown = [await gateway_metrics(http, gw)]
    async with http.get(gw.url + "/admin/endpoints", headers=ADMIN) as resp:
        shown.append(await resp.text())
    async with http.get(gw.url + "/debug/endpoints") as resp:
        shown.append(await resp.text())
    shown.extend(r.getMessage() for r in caplog.records)
    assert engine.name in shown[0]
    assert not [text for text in shown if "s3cr3t" in text or "alice" in text]


async def test_api_key_wins_over_user_info(stack: contextlib.AsyncExitStack, start_gateway, http):
    engine = await stack.enter_async_context(running_engine(Engine(required_auth="Bearer engine-key")))
    url = engine.url.replace("http://", "http://alice:pw@")
    gw = await start_gateway([{"url": url, "api_key": "engine-key"}])
    status, body, _ = await _chat(http, gw)
    assert status == 200, body
    assert {s.headers.get("authorization") for s in engine.seen} == {"Bearer engine-key"}
