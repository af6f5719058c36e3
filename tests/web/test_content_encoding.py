"""Request bodies whose Content-Encoding lies are the client's error: 400, OpenAI-style, no traceback.

aiohttp decodes gzip and deflate bodies itself; a body that is not what its header says
raises inside ``request.read()``, which the gateway used to answer with a 500 and an
ERROR traceback. A real gzip body must keep working (the upstream gets plain JSON).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import zlib

import aiohttp
import pytest

from tests.support.harness import chat_body

_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/admin/endpoints")
ADMIN_KEY = "admin-secret"
ADMIN_AUTH = {"admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}


def _assert_no_error_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert bad == [], [f"{r.name}: {r.getMessage()}" for r in bad]


async def _post(http: aiohttp.ClientSession, url: str, body: bytes, encoding: str) -> tuple[int, dict]:
    headers = {
        "content-type": "application/json",
        "content-encoding": encoding,
        "authorization": f"Bearer {ADMIN_KEY}",  # the admin API reads its body only past the key
    }
    async with http.post(url, data=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.mark.parametrize("encoding", ["deflate", "gzip"])
async def test_a_lying_content_encoding_is_a_400_with_an_openai_error(
    start_upstream, start_gateway, encoding, caplog
):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url], auth=ADMIN_AUTH)
    plain = json.dumps(chat_body()).encode()
    caplog.set_level(logging.INFO)
    # A fresh connection per request: after a broken body the gateway closes the connection.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        for path in _PATHS:
            status, body = await _post(http, gw.url + path, plain, encoding)
            assert status == 400, (path, body)
            assert body["error"]["type"] == "invalid_request_error"
            assert body["error"]["code"] == "invalid_body_encoding"
            assert encoding in body["error"]["message"]
        # The Messages route answers in Anthropic's format.
        status, body = await _post(http, gw.url + "/v1/messages", plain, encoding)
        assert status == 400, body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert encoding in body["error"]["message"]
        # A route that never reads the body (unknown path): aiohttp drains it after the
        # answer, and that drain fails the same way; still no ERROR traceback.
        status, _ = await _post(http, gw.url + "/v1/no-such-path", plain, encoding)
        assert status == 404
        async with http.get(gw.url + "/health") as resp:  # and the gateway is fine
            assert resp.status == 200
    assert upstream.requests == []
    _assert_no_error_tracebacks(caplog)


async def test_an_encoding_aiohttp_cannot_decode_is_a_400_with_an_openai_error(
    start_upstream, start_gateway, caplog
):
    """``br`` / ``zstd`` without their decoder: aiohttp itself rejects the request while
    parsing; the answer must still be the gateway's error format and no ERROR log."""
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url])
    caplog.set_level(logging.INFO)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        for encoding in ("br", "zstd"):
            status, body = await _post(http, gw.url + "/v1/chat/completions", b"{}", encoding)
            if status == 200:  # pragma: no cover - the decoder is installed: nothing to test
                continue
            assert status == 400
            assert body["error"]["type"] == "invalid_request_error"
            assert body["error"]["code"] == "invalid_body_encoding"
    _assert_no_error_tracebacks(caplog)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_real_compressed_body_is_decoded_and_forwarded_plain(
    start_upstream, start_gateway, http, encoding, caplog
):
    upstream = await start_upstream()
    gw = await start_gateway([upstream.url])
    plain = json.dumps(chat_body(max_tokens=3)).encode()
    encoded = gzip.compress(plain) if encoding == "gzip" else zlib.compress(plain)
    status, body = await _post(http, gw.url + "/v1/chat/completions", encoded, encoding)
    assert status == 200, body
    assert body["object"] == "chat.completion"
    (received,) = upstream.requests
    assert received.json["max_tokens"] == 3  # the upstream got the decoded JSON
    _assert_no_error_tracebacks(caplog)
