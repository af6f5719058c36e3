"""Adversarial: the keys file rewritten under a running gateway (half-written, broken, swapped)."""

from __future__ import annotations

import asyncio
import os

import yaml

from gateway.auth import hash_key
from gateway.http.reload import ConfigReloader
from gateway.http.server import _reload_keys, _watch_keys
from tests.support.harness import chat_body


def doc(*keys: str) -> str:
    return yaml.safe_dump(
        {
            "tenants": {"acme": {"requests_per_minute": 1000}},
            "keys": [{"sha256": hash_key(k), "tenant": "acme", "name": f"clé-{k}"} for k in keys],
        },
        allow_unicode=True,
    )


def half_written(text: str) -> bytes:
    """The file as a reader sees it while the writer is mid-way: cut inside the 2-byte 'é'."""
    data = text.encode()
    cut = data.rindex("é".encode()) + 1
    return data[:cut]


async def status_of(http, gw, key: str) -> int:
    async with http.post(
        gw.url + "/v1/chat/completions", json=chat_body(), headers={"authorization": f"Bearer {key}"}
    ) as resp:
        return resp.status


async def test_keys_watch_survives_a_half_written_file(start_upstream, start_gateway, http, tmp_path):
    upstream = await start_upstream()
    path = tmp_path / "keys.yaml"
    path.write_text(doc("sk-old"))
    gw = await start_gateway([upstream.url], auth={"enabled": True, "keys_file": str(path)})
    watch = asyncio.create_task(_watch_keys(gw.state, interval_s=0.1))
    try:
        path.write_bytes(half_written(doc("sk-old", "sk-new")))  # the watcher catches it mid-write
        await asyncio.sleep(0.4)
        assert await status_of(http, gw, "sk-old") == 200  # previous keys still serve
        path.write_text(doc("sk-old", "sk-new"))  # the write completes
        os.utime(path)
        await asyncio.sleep(0.4)
        assert not watch.done(), f"keys-watch task died: {watch.exception()!r}"
        assert await status_of(http, gw, "sk-new") == 200
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)


async def test_sighup_with_a_half_written_keys_file_keeps_the_old_keys_and_says_so(
    start_upstream, start_gateway, http, tmp_path, caplog
):
    upstream = await start_upstream()
    path = tmp_path / "keys.yaml"
    path.write_text(doc("sk-old"))
    gw = await start_gateway([upstream.url], auth={"enabled": True, "keys_file": str(path)})
    path.write_bytes(half_written(doc("sk-old", "sk-new")))
    _reload_keys(gw.state)  # what the SIGHUP handler runs: it must log a rejection, not raise
    assert "keys file rejected" in caplog.text
    assert await status_of(http, gw, "sk-old") == 200


async def test_config_reload_with_a_half_written_keys_file_is_rejected_not_crashed(
    start_upstream, start_gateway, http, tmp_path
):
    upstream = await start_upstream()
    keys = tmp_path / "keys.yaml"
    keys.write_text(doc("sk-old"))
    config = tmp_path / "gateway.yaml"
    config.write_text(
        yaml.safe_dump(
            {"endpoints": [{"url": upstream.url}], "auth": {"enabled": True, "keys_file": str(keys)}}
        )
    )
    gw = await start_gateway([upstream.url], auth={"enabled": True, "keys_file": str(keys)})
    keys.write_bytes(half_written(doc("sk-old", "sk-new")))
    result = await ConfigReloader(gw.state, config).reload()
    assert result == "rejected"
