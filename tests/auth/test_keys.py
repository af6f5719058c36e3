"""API keys: hashing, extraction from real HTTP requests, and the YAML file store with hot reload."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from gateway.auth import (
    FileKeyStore,
    KeyFileError,
    Tenant,
    build_key_store,
    extract_key,
    hash_key,
    key_fingerprint,
    matches_hash,
)
from gateway.config import AuthConfig
from tests.prefix.conftest import free_port

ACME_KEY = "sk-acme-0123456789abcdef"
CI_KEY = "sk-ci-fedcba9876543210"
BETA_KEY = "sk-beta-00000000000000"


def write_keys(path: Path, tenants: dict[str, Any], keys: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"tenants": tenants, "keys": keys}))
    return path


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    return write_keys(
        tmp_path / "keys.yaml",
        {
            "acme": {
                "priority": "standard",
                "models": ["llama-3-8b", "qwen-7b"],
                "requests_per_minute": 600,
                "tokens_per_minute": 200000,
                "debug": True,
            },
            "beta": {"priority": "sheddable"},
        },
        [
            {"sha256": hash_key(ACME_KEY), "tenant": "acme", "name": "prod-key"},
            {"sha256": hash_key(CI_KEY).upper(), "tenant": "acme", "name": "ci-key"},
            {"sha256": hash_key(BETA_KEY), "tenant": "beta"},
        ],
    )


def test_hash_key_is_hex_sha256() -> None:
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert hash_key("ключ") == hashlib.sha256("ключ".encode()).hexdigest()
    assert key_fingerprint("abc") == "ba7816bf"
    assert matches_hash("abc", "BA7816BF8F01CFEA414140DE5DAE2223B00361A396177A9CB410FF61F20015AD\n")
    assert not matches_hash("abd", hash_key("abc"))


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ({"Authorization": "Bearer sk-1"}, "sk-1"),
        ({"authorization": "bearer   sk-2  "}, "sk-2"),
        ({"x-api-key": "sk-3"}, "sk-3"),
        ({"X-API-Key": "sk-4"}, "sk-4"),
        ({"Authorization": "Bearer sk-5", "x-api-key": "sk-other"}, "sk-5"),
        ({"Authorization": "Basic dXNlcjpwYXNz", "x-api-key": "sk-6"}, "sk-6"),
        ({"Authorization": "Bearer "}, None),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, None),
        ({"x-api-key": "  "}, None),
        ({}, None),
    ],
)
def test_extract_key_from_a_plain_mapping(headers: dict[str, str], key: str | None) -> None:
    assert extract_key(headers) == key


async def test_extract_key_from_real_requests(http: aiohttp.ClientSession) -> None:
    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"key": extract_key(request.headers)})

    app = web.Application()
    app.router.add_get("/", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        cases = [
            ({"Authorization": "Bearer sk-real"}, "sk-real"),
            ({"AUTHORIZATION": "BEARER sk-upper"}, "sk-upper"),
            ({"X-Api-Key": "sk-header"}, "sk-header"),
            ({}, None),
        ]
        for headers, expected in cases:
            async with http.get(f"http://127.0.0.1:{port}/", headers=headers) as resp:
                assert (await resp.json())["key"] == expected
    finally:
        await runner.cleanup()


async def test_file_store_maps_keys_to_tenants(keys_file: Path) -> None:
    store = FileKeyStore(keys_file)
    acme = await store.lookup(ACME_KEY)
    assert acme == Tenant(
        name="acme",
        priority="standard",
        models=frozenset({"llama-3-8b", "qwen-7b"}),
        requests_per_minute=600,
        tokens_per_minute=200000,
        debug=True,
    )
    assert acme is not None and acme.key_name == "prod-key"
    assert acme.allows_model("qwen-7b") and not acme.allows_model("gpt-4")
    ci = await store.lookup(CI_KEY)  # upper-case hex in the file is accepted
    assert ci == acme and ci is not None and ci.key_name == "ci-key"
    beta = await store.lookup(BETA_KEY)  # defaults: every model, unlimited, no debug
    assert beta == Tenant(name="beta", priority="sheddable")
    assert beta is not None and beta.allows_model("anything") and not beta.limited
    assert await store.lookup("sk-unknown") is None
    assert await store.lookup(hash_key(ACME_KEY)) is None  # the stored hash is not a key
    assert len(store) == 3 and set(store.tenants()) == {"acme", "beta"}


def test_build_key_store_reads_the_file(keys_file: Path) -> None:
    store = build_key_store(AuthConfig(enabled=True, keys_file=str(keys_file)))
    assert isinstance(store, FileKeyStore) and store.lookup_now(BETA_KEY) is not None
    with pytest.raises(KeyFileError, match="cannot read keys file"):
        build_key_store(AuthConfig(enabled=True, keys_file=str(keys_file.parent / "missing.yaml")))


@pytest.mark.parametrize(
    ("document", "messages"),
    [
        (
            {"tenants": {"acme": {"priority": "urgent"}}, "keys": []},
            ["tenants.acme.priority: Input should be 'critical', 'standard' or 'sheddable'"],
        ),
        (
            {"tenants": {"acme": {"requests_per_minute": -1, "colour": "red"}}},
            [
                "tenants.acme.requests_per_minute: Input should be greater than or equal to 0",
                "tenants.acme.colour: Extra inputs are not permitted",
            ],
        ),
        (
            {"tenants": {"acme": {}}, "keys": [{"sha256": "a" * 64, "tenant": "acme"}, {"tenant": "acme"}]},
            ["keys.1.sha256: Field required"],
        ),
        (
            {"tenants": {"acme": {}}, "keys": [{"sha256": "sk-live-raw-key", "tenant": "acme"}]},
            ["keys.0.sha256: must be the hex sha256 of the key (64 hex digits), not the key itself"],
        ),
        (
            {"tenants": {"acme": {}}, "keys": [{"sha256": "a" * 64, "tenant": "acne"}]},
            ["keys.0.tenant: unknown tenant 'acne' (defined: ['acme'])"],
        ),
        (
            {"tenants": {"acme": {}}, "keys": [{"sha256": "a" * 64, "tenant": "acme"}] * 2},
            ["keys.1.sha256: duplicate of keys.0.sha256"],
        ),
        ({"tenants": {"a{b}": {}}}, ["tenants.a{b}: tenant names use letters, digits"]),
        ({"keys": []}, ["tenants: Field required"]),
        (["not", "a", "mapping"], ["top level must be a mapping"]),
    ],
)
def test_invalid_files_name_the_key_path(tmp_path: Path, document: Any, messages: list[str]) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(KeyFileError) as info:
        FileKeyStore(path)
    text = str(info.value)
    assert str(path) in text
    for message in messages:
        assert message in text
    assert "sk-live-raw-key" not in text  # a misplaced raw key is never echoed


def test_yaml_syntax_error_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("tenants: {acme: [\n")
    with pytest.raises(KeyFileError, match="is not valid YAML"):
        FileKeyStore(path)


def test_reload_swaps_keys_and_keeps_the_old_ones_on_a_bad_edit(
    keys_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = FileKeyStore(keys_file)
    assert store.lookup_now(ACME_KEY) is not None

    new_key = "sk-gamma-11111111"
    write_keys(
        keys_file, {"gamma": {"priority": "critical"}}, [{"sha256": hash_key(new_key), "tenant": "gamma"}]
    )
    assert store.reload() == 1
    assert store.lookup_now(ACME_KEY) is None  # revoked by the edit
    gamma = store.lookup_now(new_key)
    assert gamma is not None and gamma.priority == "critical"

    keys_file.write_text(keys_file.read_text().replace("critical", "urgent"))
    caplog.set_level(logging.INFO, logger="gateway.auth")
    with pytest.raises(KeyFileError, match=r"tenants\.gamma\.priority"):
        store.reload()
    assert store.lookup_now(new_key) == gamma  # still serving the last good file
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "tenants.gamma.priority" in errors[0].getMessage()
    assert "still serving the 1 keys loaded before" in errors[0].getMessage()
    assert new_key not in caplog.text and hash_key(new_key) not in caplog.text

    keys_file.unlink()
    with pytest.raises(KeyFileError, match="cannot read keys file"):
        store.reload()
    assert store.lookup_now(new_key) == gamma


def test_reload_if_changed_reloads_only_on_change(keys_file: Path) -> None:
    store = FileKeyStore(keys_file)
    assert store.reload_if_changed() is False
    write_keys(keys_file, {"beta": {}}, [{"sha256": hash_key(BETA_KEY), "tenant": "beta"}])
    stat = keys_file.stat()
    os.utime(keys_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # coarse mtime clocks
    assert store.reload_if_changed() is True
    assert store.lookup_now(ACME_KEY) is None and store.lookup_now(BETA_KEY) is not None
    assert store.reload_if_changed() is False

    keys_file.write_text("tenants: 3\n")
    stat = keys_file.stat()
    os.utime(keys_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
    with pytest.raises(KeyFileError):
        store.reload_if_changed()
    assert store.reload_if_changed() is False  # a broken edit is reported once, not on every poll
    assert store.lookup_now(BETA_KEY) is not None
