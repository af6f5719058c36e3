"""Configuration: validation errors name the key; file < environment < overrides; the CLI exits 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.cli import main
from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.http.app import build_app
from gateway.http.state import STATE

ROOT = Path(__file__).resolve().parents[1]
EP = [{"url": "http://127.0.0.1:9001"}]


def load(raw: dict[str, Any], **kw: Any):
    return load_config(overrides=raw, environ=kw.pop("environ", {}), **kw)


def build(raw: dict[str, Any]):
    return build_app(load(raw))


def profile(*refs: str, name: str = "p") -> dict[str, Any]:
    return {"name": name, "plugins": [{"ref": r} for r in refs]}


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"bogus": 1}, "bogus"),
        ({"server": {"prot": 8080}}, "server.prot"),
        ({"endpoints": [{"url": "http://a:1", "weight": 2}]}, "endpoints.0.weight"),
        ({"server": {"port": 70000}}, "server.port"),
        ({"server": {"port": "eighty"}}, "server.port"),
        (
            {"endpoints": [{"url": "http://a:1"}, {"url": "http://b:1", "role": "primary"}]},
            "endpoints.1.role",
        ),
        ({"endpoints": [{"url": "http://a:1", "engine": "tgi"}]}, "endpoints.0.engine"),
        ({"endpoints": [{"url": "a:1"}]}, "endpoints.0.url"),
        (
            {"endpoints": [{"url": "http://a:1"}, {"url": "http://b:2"}, {"url": "http://a:1/"}]},
            "endpoints.2.url",
        ),
        ({"health": {"interval_s": 0}}, "health.interval_s"),
        ({"limits": {"retries": 9}}, "limits.retries"),
        ({"admission": {"queue_depth_threshold": 0}}, "admission.queue_depth_threshold"),  # idle = saturated
        ({"admission": {"slo": {"training_per_s": 0}}}, "admission.slo.training_per_s"),
        ({"admission": {"slo": {"training_per_s": True}}}, "admission.slo.training_per_s"),
        ({"log_level": "loud"}, "log_level"),
        (
            {"policy": "round-robin", "plugins": [{"type": "random"}], "profiles": [profile("random")]},
            "policy",
        ),
        ({"plugins": [{"type": "random"}]}, "profiles"),
        (
            {"plugins": [{"type": "random"}, {"type": "random"}], "profiles": [profile("random")]},
            "plugins.1.name",
        ),
        (
            {"plugins": [{"type": "random"}], "profiles": [profile("random", "ghost")]},
            "profiles.0.plugins.1.ref",
        ),
        (
            {"plugins": [{"type": "random", "params": {}}], "profiles": [profile("random")]},
            "plugins.0.params",
        ),
    ],
)
def test_schema_errors_name_the_key(raw, key):
    with pytest.raises(ConfigError) as info:
        load(raw)
    message = str(info.value)
    assert message.startswith("invalid configuration: ")
    assert f"{key}:" in message


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"policy": "fastest"}, "policy"),
        (
            {"plugins": [{"type": "healthy"}, {"type": "telepathy"}], "profiles": [profile("healthy")]},
            "plugins.1.type",
        ),
        (
            {
                "plugins": [{"type": "in-flight", "parameters": {"by": "vibes"}}],
                "profiles": [profile("in-flight")],
            },
            "plugins.0.parameters.by",
        ),
        (
            {
                "plugins": [{"type": "round-robin", "parameters": {"jitter": 1}}],
                "profiles": [profile("round-robin")],
            },
            "plugins.0.parameters.jitter",
        ),
        # Picker placed wrong: two in one profile, or a profile handler referenced from a profile.
        (
            {
                "plugins": [{"type": "random"}, {"type": "max-score"}],
                "profiles": [profile("random", "max-score")],
            },
            "profiles.0.plugins",
        ),
        (
            {"plugins": [{"type": "random"}, {"type": "single"}], "profiles": [profile("random", "single")]},
            "profiles.0.plugins.1.ref",
        ),
        (
            {
                "plugins": [{"type": "single"}, {"type": "single", "name": "other"}, {"type": "random"}],
                "profiles": [profile("random")],
            },
            "plugins",
        ),
        (
            {"plugins": [{"type": "random"}], "profiles": [profile("random"), profile("random")]},
            "profiles.1.name",
        ),
    ],
)
def test_plugin_errors_name_the_key_at_start_up(raw, key):
    config = load({**raw, "endpoints": EP})  # the schema itself is fine
    with pytest.raises(ConfigError) as info:
        build_app(config)
    assert str(info.value).startswith(f"{key}:")


def test_error_messages_are_specific():
    with pytest.raises(ConfigError, match=r"profiles\.0\.plugins\.1\.ref: 'single' is a profile-handler"):
        build(
            {"plugins": [{"type": "random"}, {"type": "single"}], "profiles": [profile("random", "single")]}
        )
    with pytest.raises(ConfigError, match=r"unknown plugin 'ghost' \(defined: \['random'\]\)"):
        load({"plugins": [{"type": "random"}], "profiles": [profile("ghost")]})
    with pytest.raises(ConfigError, match=r"known: .*round-robin"):
        build({"policy": "fastest"})


def test_env_overrides():
    config = load_config(
        environ={
            "LLM_GATEWAY_SERVER__PORT": "9123",
            "LLM_GATEWAY_ENDPOINTS": "http://10.0.0.1:8000, http://10.0.0.2:8000/,",
            "LLM_GATEWAY_HEALTH__INTERVAL_S": "0.25",
            "LLM_GATEWAY_POLICY": "round-robin",
            "LLM_GATEWAY_TIMEOUTS__FIRST_BYTE_S": "12",
            "OTHER_PREFIX_SERVER__PORT": "1",
        }
    )
    assert config.server.port == 9123
    assert [e.url for e in config.endpoints] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert config.health.interval_s == 0.25
    assert config.policy == "round-robin"
    assert config.timeouts.first_byte_s == 12.0


def test_env_shortcuts_and_errors():
    config = load_config(environ={"LLM_GATEWAY_PORT": "9200", "LLM_GATEWAY_HOST": "0.0.0.0"})
    assert (config.server.port, config.server.host) == (9200, "0.0.0.0")
    with pytest.raises(ConfigError, match=r"server\.port:"):
        load_config(environ={"LLM_GATEWAY_SERVER__PORT": "not-a-port"})
    with pytest.raises(ConfigError, match=r"server\.prot:"):
        load_config(environ={"LLM_GATEWAY_SERVER__PROT": "1"})
    with pytest.raises(ConfigError, match=r"endpoints\.0\.url:"):
        load_config(environ={"LLM_GATEWAY_ENDPOINTS": "localhost:8000"})


def test_yaml_file_and_precedence(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text(
        """
server:
  port: 8100
  max_body_bytes: 4096
endpoints:
  - url: http://10.0.0.1:8000
    models: [llama]
    role: prefill
    labels: {zone: a}
  - url: http://10.0.0.2:8000
    engine: sglang
plugins:
  - type: healthy
  - type: queue-depth
    name: queue
  - type: max-score
    parameters: {seed: 3}
profiles:
  - name: default
    plugins:
      - ref: healthy
      - ref: queue
        weight: 2.5
      - ref: max-score
"""
    )
    config = load_config(path, environ={})
    assert config.server.port == 8100
    assert config.server.max_body_bytes == 4096
    first, second = config.endpoints
    assert (first.models, first.role, first.labels) == (["llama"], "prefill", {"zone": "a"})
    assert second.engine == "sglang"
    assert config.profiles[0].plugins[1].weight == 2.5
    scheduler = build_app(config)[STATE].routing.scheduler
    (only,) = scheduler.profiles.values()
    assert [(ws.scorer.name, ws.weight) for ws in only.scorers] == [("queue", 2.5)]
    assert [f.name for f in only.filters] == ["healthy"]

    # file < environment < overrides
    env = {"LLM_GATEWAY_SERVER__PORT": "8200"}
    assert load_config(path, environ=env).server.port == 8200
    assert load_config(path, environ=env, overrides={"server": {"port": 8300}}).server.port == 8300
    # merging is per key: the file's max_body_bytes survives a port override
    assert load_config(path, environ=env).server.max_body_bytes == 4096


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("- just\n- a list\n", "top level must be a mapping"),
        ("server: {port: [unclosed\n", "cannot read config file"),
        ("server:\n  port: 8080\n  colour: blue\n", r"server\.colour:"),
    ],
)
def test_bad_yaml_files(tmp_path, content, match):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        load_config(path, environ={})


def test_empty_file_is_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    config = load_config(path, environ={})
    assert config.server.port == 8080
    assert config.endpoints == []


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path):
    """Not a UnicodeDecodeError: the reloader and the worker supervisor catch ConfigError (a
    SIGHUP reload's task died on it, and a worker's respawn killed the supervisor)."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"# caf\xe9\nserver:\n  port: 8080\n")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(path, environ={})


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml", environ={})


@pytest.mark.parametrize(
    ("yaml_text", "key"),
    [
        ("endpoints:\n  - url: http://127.0.0.1:1\n    role: primary\n", "endpoints.0.role"),
        (
            "endpoints: [{url: 'http://127.0.0.1:1'}]\nplugins: [{type: nope}]\n"
            "profiles: [{name: p, plugins: [{ref: nope}]}]\n",
            "plugins.0.type",
        ),
        ("server: {port: 8080}\n", "endpoints"),
    ],
)
def test_cli_serve_with_bad_config_exits_2(tmp_path, capsys, monkeypatch, yaml_text, key):
    for name in [k for k in os.environ if k.startswith("LLM_GATEWAY_")]:
        monkeypatch.delenv(name)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llm-gateway: ")
    assert f"{key}:" in err


def test_cli_serve_subprocess_exits_2_naming_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("endpoints:\n  - url: http://127.0.0.1:1\nhealth:\n  unhealthy_threshold: 0\n")
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "health.unhealthy_threshold:" in proc.stderr


@pytest.mark.parametrize("value", [0.001, 0.5, -1])
def test_a_worker_timeout_is_off_or_at_least_a_second(value):
    with pytest.raises(ValidationError, match="worker_timeout_s"):
        GatewayConfig.model_validate({"server": {"worker_timeout_s": value}})
    assert GatewayConfig.model_validate({"server": {"worker_timeout_s": 0}}).server.worker_timeout_s == 0
