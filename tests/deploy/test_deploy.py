"""Deployment artifacts: the Grafana dashboard, Prometheus rules and Kubernetes manifests.

Metric names are checked against what a real gateway exports, so a renamed metric breaks a test
instead of a dashboard panel. The manifests' gateway config is loaded, built and served for real
(discovery against a local API server, API keys from the Secret's template), so a manifest that
no longer matches the code breaks a test instead of a rollout.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import posixpath
import re
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import openai
import pytest
import redis.asyncio as aioredis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.auth import hash_key
from gateway.auth.keyfile import KeyFileError, load_keys_file
from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.fleet.discovery.kubernetes import Skip, endpoint_from_pod
from gateway.http.app import build_app
from gateway.http.presets import DEFAULT_POLICY, preset, scheduler_specs
from gateway.http.server import start_site
from gateway.http.state import STATE
from tests.fleet.discovery.apiserver import make_pod, running_apiserver
from tests.prefix.conftest import key_prefix, redis_url
from tests.support.harness import Gateway, chat_body, free_port, gateway_metrics, wait_until
from tests.support.workers import spawn_gateway

__all__ = ["key_prefix", "redis_url"]  # fixtures

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "llm-gateway.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
K8S = ROOT / "deploy" / "k8s"

# Metric identifiers; recording-rule names (llm_gateway:...) contain a colon and are not matched.
METRIC_RE = re.compile(r"\bllm_gateway_[A-Za-z0-9_]*[A-Za-z0-9]\b(?!:)")
POOL_GAUGES = {
    "llm_gateway_pool_desired_replicas",
    "llm_gateway_pool_current_replicas",
    "llm_gateway_pool_kv_utilization",
    "llm_gateway_pool_queue_depth",
}
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
}


def exported_sample_names(text: str) -> set[str]:
    """Every sample name the exposition holds, plus the names a family with no child yet will use."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


def unknown_metrics(exprs: list[str], known: set[str]) -> dict[str, set[str]]:
    allowed = set(known)
    if importlib.util.find_spec("gateway.fleet.autoscale") is None:
        allowed |= POOL_GAUGES  # the autoscaling gauges are not merged yet
    out: dict[str, set[str]] = {}
    for expr in exprs:
        missing = set(METRIC_RE.findall(expr)) - allowed
        if missing:
            out[expr] = missing
    return out


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = list(dashboard["panels"])
    for panel in list(panels):
        panels.extend(panel.get("panels", []))  # collapsed rows
    return [t["expr"] for p in panels for t in p.get("targets", []) if "expr" in t]


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d is not None)
    return docs


def one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


@pytest.fixture
async def exported(start_sim, start_gateway, http, tmp_path) -> set[str]:
    """What a single-process gateway and a ``serve --workers 2`` one export (the workers'
    own series, e.g. ``llm_gateway_worker_respawns_total``, exist only in the second)."""
    sims = [await start_sim(model="m"), await start_sim(model="m")]
    gw = await start_gateway([s.url for s in sims])
    for stream in (False, True, False, True):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body("m", stream=stream)) as resp:
            assert resp.status == 200
            await resp.read()
    names = exported_sample_names(await gateway_metrics(http, gw))
    workers = await spawn_gateway([s.url for s in sims], ["--workers", "2"], tmp_path)
    try:
        async with http.get(workers.url + "/metrics") as resp:
            assert resp.status == 200
            return names | exported_sample_names(await resp.text())
    finally:
        await workers.stop()


# --- Dashboard and rules against the real /metrics --------------------------------------------


async def test_dashboard_and_rules_reference_only_exported_metrics(exported):
    # The scrape really happened and carries the labelled series the panels are built on.
    assert "llm_gateway_requests_total" in exported
    assert "llm_gateway_time_to_first_byte_seconds_bucket" in exported
    assert "llm_gateway_endpoint_in_flight_requests" in exported  # scrape-time collector
    # The checker rejects what the gateway does not export (family names without suffix included).
    bad = ["rate(llm_gateway_nope_total[5m])", "rate(llm_gateway_requests[5m])"]
    assert set(unknown_metrics(bad, exported)) == set(bad)

    dash = dashboard_exprs()
    rule_exprs = [r["expr"] for r in rules()]
    assert len(dash) >= 20 and len(rule_exprs) >= 8
    assert unknown_metrics(dash, exported) == {}
    assert unknown_metrics(rule_exprs, exported) == {}
    # Every dashboard expr actually names a gateway metric.
    assert all(METRIC_RE.search(e) for e in dash)


async def test_pool_gauges_required_once_autoscale_exists(exported):
    referenced = {m for e in dashboard_exprs() for m in METRIC_RE.findall(e)}
    assert POOL_GAUGES <= referenced
    if importlib.util.find_spec("gateway.fleet.autoscale") is not None:
        assert POOL_GAUGES <= exported


def test_dashboard_shape():
    dashboard = json.loads(DASHBOARD.read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys()
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
    exprs = "\n".join(dashboard_exprs())
    assert (
        "histogram_quantile(0.99, sum by (le, model) (rate(llm_gateway_time_to_first_byte_seconds_bucket"
        in exprs
    )
    assert (
        "histogram_quantile(0.99, sum by (le, model) (rate(llm_gateway_request_duration_seconds_bucket"
        in exprs
    )


# Gauges every worker (and every gateway replica) reports for the same endpoint: the engine's own
# numbers and 0/1 states are taken once per endpoint (max); the gateway's in-flight counts are
# each worker's view of the whole gateway (max over workers), summed over gateway replicas.
_ONCE_PER_ENDPOINT = re.compile(
    r"llm_gateway_endpoint_(queue_depth|running_requests|kv_cache_utilization|healthy|metrics_stale"
    r"|saturated|ejected)\b"
)
_PER_GATEWAY = re.compile(
    r"llm_gateway_endpoint_(in_flight_requests|in_flight_prompt_tokens|pending_prefill_tokens)\b"
)


def test_dashboard_never_adds_up_what_each_worker_reports_for_the_whole_gateway():
    for expr in dashboard_exprs():
        if (m := _ONCE_PER_ENDPOINT.search(expr)) is not None:
            assert f"max by (endpoint) ({m.group(0)})" in expr, expr
        if (m := _PER_GATEWAY.search(expr)) is not None:
            assert f"max without (worker) ({m.group(0)})" in expr, expr


def test_rules_structure():
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    names = [g["name"] for g in doc["groups"]]
    assert len(names) == len(set(names))
    alerts = {}
    for rule in rules():
        assert isinstance(rule.get("expr"), str) and rule["expr"].strip(), rule
        assert ("record" in rule) != ("alert" in rule), rule
        if "alert" in rule:
            assert re.fullmatch(r"\d+[smh]", str(rule["for"])), rule
            assert rule["annotations"]["summary"], rule
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}
            alerts[rule["alert"]] = rule
        else:
            assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["record"]), rule
            assert "for" not in rule and "annotations" not in rule
    assert (
        "sum by (instance) (llm_gateway_endpoint_healthy) == 0"
        in alerts["LLMGatewayNoHealthyEndpoints"]["expr"]
    )
    stale = alerts["LLMGatewayEndpointMetricsStale"]
    assert stale["expr"].strip() == "llm_gateway_endpoint_metrics_stale == 1" and stale["for"] == "1m"
    ejected = alerts["LLMGatewayEndpointEjected"]
    assert "llm_gateway_endpoint_ejected" in ejected["expr"] and ejected["for"] == "5m"
    assert 'result="rejected"' in alerts["LLMGatewayConfigReloadRejected"]["expr"]
    assert "llm_gateway_retry_budget_exhausted_total" in alerts["LLMGatewayRetryBudgetExhausted"]["expr"]
    assert len(alerts) == 11


# --- Kubernetes manifests ---------------------------------------------------------------------


def test_every_k8s_document_is_identified():
    docs = k8s_docs()
    kinds = {d["kind"] for d in docs}
    assert {
        "Deployment",
        "Service",
        "ConfigMap",
        "ServiceAccount",
        "PodDisruptionBudget",
        "ScaledObject",
    } <= kinds
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), doc
        assert doc["metadata"].get("name"), doc


def test_gateway_deployment():
    dep = one("Deployment", "llm-gateway")
    spec = dep["spec"]
    pod = spec["template"]["spec"]
    assert spec["replicas"] == 2
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    (container,) = pod["containers"]
    assert container["image"] == "llm-gateway:0.1.0"
    assert container["args"] == [
        "--config",
        "/etc/llm-gateway/gateway.yaml",
        "--host",
        "0.0.0.0",
        "--port",
        "8080",
    ]
    ports = {p["containerPort"] for p in container["ports"]} | {p["name"] for p in container["ports"]}
    assert 8080 in ports
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in ports
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    anti = pod["affinity"]["podAntiAffinity"]
    terms = anti.get("requiredDuringSchedulingIgnoredDuringExecution", []) + [
        t["podAffinityTerm"] for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])
    ]
    assert any(
        t["labelSelector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
        for t in terms
    )
    assert pod["serviceAccountName"] == one("ServiceAccount", pod["serviceAccountName"])["metadata"]["name"]
    # The config volume mounts the ConfigMap at the directory --config reads from.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    config_volume = next(n for n, v in volumes.items() if "configMap" in v)
    assert mounts[config_volume] == "/etc/llm-gateway"
    assert "gateway.yaml" in one("ConfigMap", volumes[config_volume]["configMap"]["name"])["data"]


@pytest.mark.parametrize(
    ("service", "deployment"), [("llm-gateway", "llm-gateway"), ("llm-gateway-redis", "llm-gateway-redis")]
)
def test_service_selects_deployment_pods(service, deployment):
    svc = one("Service", service)
    dep = one("Deployment", deployment)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"] and svc["spec"]["selector"].items() <= pod_labels.items()
    container_ports = {p["name"] for c in dep["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert all(p["targetPort"] in container_ports for p in svc["spec"]["ports"])


def test_pdb_selects_gateway_pods():
    pdb = one("PodDisruptionBudget", "llm-gateway")
    labels = one("Deployment", "llm-gateway")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] < one("Deployment", "llm-gateway")["spec"]["replicas"]


EXAMPLE = ROOT / "deploy" / "examples" / "gateway.yaml"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"  # where the kubelet mounts the pod's token
REDIS_DB = re.compile(r"/(\d+)$")


def gateway_yaml(configmap: dict[str, Any]) -> str:
    return configmap["data"]["gateway.yaml"]


def production_yaml() -> str:
    return gateway_yaml(one("ConfigMap", "llm-gateway-config"))


def load_gateway_config(raw: str, tmp_path: Path, environ: dict[str, str] | None = None) -> GatewayConfig:
    path = tmp_path / "gateway.yaml"
    path.write_text(raw)
    return load_config(path, environ=environ or {})


def gateway_pod() -> dict[str, Any]:
    return one("Deployment", "llm-gateway")["spec"]["template"]["spec"]


def gateway_container() -> dict[str, Any]:
    (container,) = gateway_pod()["containers"]
    return container


def selector_terms(selector: str) -> list[tuple[str, str, str]]:
    """Equality-based label selector terms (``k=v``, ``k==v``, ``k!=v``); anything else fails the test."""
    terms = []
    for term in filter(None, (t.strip() for t in selector.split(","))):
        match = re.fullmatch(r"([^!=\s]+)\s*(==|=|!=)\s*([^!=\s]*)", term)
        assert match, f"unsupported selector term {term!r}"
        terms.append((match[1], match[2], match[3]))
    return terms


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    return all((labels.get(key) == value) == (op != "!=") for key, op, value in selector_terms(selector))


def keys_template() -> str:
    return one("Secret", "llm-gateway-api-keys")["stringData"]["keys.yaml"]


def filled_keys(tmp_path: Path) -> tuple[Path, list[str]]:
    """The Secret's keys.yaml with each REPLACE_ME replaced by the hash of a distinct test key."""
    raw_keys: list[str] = []

    def fill(_match: re.Match[str]) -> str:
        raw_keys.append(f"sk-deploy-test-{len(raw_keys)}")
        return hash_key(raw_keys[-1])

    path = tmp_path / "keys.yaml"
    path.write_text(re.sub("REPLACE_ME", fill, keys_template()))
    return path, raw_keys


def with_keys_file(config: GatewayConfig, keys_file: Path) -> GatewayConfig:
    return config.model_copy(update={"auth": config.auth.model_copy(update={"keys_file": str(keys_file)})})


@pytest.fixture
def in_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the kubelet injects into every container; in-cluster discovery finds the API server by it."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")


def test_configmap_gateway_config_builds(tmp_path, in_cluster, monkeypatch):
    config = load_gateway_config(production_yaml(), tmp_path)
    redis_host = one("Service", "llm-gateway-redis")["metadata"]["name"]
    assert config.prefix.backend == "redis" and config.sessions.backend == "redis"
    assert config.auth.limits_backend == "redis"  # tenant limits hold across gateway replicas
    redis_urls = [config.prefix.redis_url, config.sessions.redis_url, config.auth.redis_url]
    assert all(f"//{redis_host}." in url for url in redis_urls)
    dbs = [REDIS_DB.search(url) for url in redis_urls]
    assert all(dbs) and len({m[1] for m in dbs if m}) == 3  # prefix, sessions, limits: one database each
    assert config.server.port == 8080 and config.server.host == "0.0.0.0"
    # Endpoints come from discovery alone, in-cluster.
    k8s = config.discovery.kubernetes
    assert config.endpoints == [] and k8s is not None and k8s.api_server is None
    assert k8s.label_selector == "app.kubernetes.io/name=vllm" and k8s.port == 8000
    assert config.auth.enabled and config.auth.backend == "file"

    keys_file, raw_keys = filled_keys(tmp_path)
    app = build_app(with_keys_file(config, keys_file))  # wiring validation; no socket, no Redis yet
    auth = app[STATE].auth
    assert auth is not None and len(auth.keys) == len(raw_keys) >= 2
    tenants = {auth.keys.lookup_now(k).name for k in raw_keys}  # type: ignore[attr-defined]
    assert tenants == set(yaml.safe_load(keys_template())["tenants"])
    # Outside a cluster the same config is refused at start-up, as is a missing keys file:
    # the gateway never starts without its endpoint source, nor open with auth on.
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(ConfigError, match=r"discovery\.kubernetes\.api_server"):
        build_app(with_keys_file(config, keys_file))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    with pytest.raises(ConfigError, match="auth"):
        build_app(with_keys_file(config, tmp_path / "missing.yaml"))


def test_example_config_has_the_configmap_structure():
    example = yaml.safe_load(EXAMPLE.read_text())
    production = yaml.safe_load(production_yaml())
    # The same sections, except where endpoints come from: listed in the example, discovered in production.
    assert "endpoints" in example and "discovery" not in example
    assert "discovery" in production and "endpoints" not in production
    assert set(example) - {"endpoints"} == set(production) - {"discovery"}
    for section, value in example.items():
        if isinstance(value, dict):
            assert set(value) == set(production[section]), section
    # The local example runs anywhere: static endpoints, auth off, no cluster, no Redis.
    config = load_config(EXAMPLE, environ={})
    assert len(config.endpoints) >= 1 and config.discovery.kubernetes is None and not config.auth.enabled
    assert config.prefix.backend == config.sessions.backend == config.auth.limits_backend == "memory"
    build_app(config)


def test_the_example_spells_out_the_default_preset_as_it_says():
    config = load_config(EXAMPLE, environ={})
    plugins, profiles = scheduler_specs(config)
    default_plugins, default_profiles = preset(DEFAULT_POLICY)
    names = [(p.type, p.instance_name) for p in plugins]
    assert names == [(p.type, p.instance_name) for p in default_plugins]
    assert [(r.ref, r.weight) for r in profiles[0].plugins] == [
        (r.ref, r.weight) for r in default_profiles[0].plugins
    ]


def test_discovery_never_selects_the_gateway_itself(tmp_path):
    selector = load_gateway_config(production_yaml(), tmp_path).discovery.kubernetes.label_selector
    for name in ("llm-gateway", "llm-gateway-redis"):
        labels = one("Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert not selector_matches(selector, labels), name
    # The model servers of the examples carry the label it selects.
    fleet = [d for d in pd_fleet() if d["kind"] == "Deployment"]
    assert fleet and all(
        selector_matches(selector, d["spec"]["template"]["metadata"]["labels"]) for d in fleet
    )


def probe_timing(probe: dict[str, Any]) -> tuple[int, int, int]:
    """periodSeconds, failureThreshold, timeoutSeconds, with Kubernetes' defaults."""
    return probe.get("periodSeconds", 10), probe.get("failureThreshold", 3), probe.get("timeoutSeconds", 1)


@pytest.mark.parametrize(
    "config_file", [K8S / "configmap.yaml", K8S / "examples" / "vllm-pd-fleet.yaml"], ids=lambda p: p.name
)
def test_grace_period_covers_drain_and_shutdown(config_file, tmp_path):
    (cm,) = [d for d in yaml.safe_load_all(config_file.read_text()) if d and d["kind"] == "ConfigMap"]
    assert {"drain_s", "shutdown_timeout_s"} <= set(yaml.safe_load(gateway_yaml(cm))["server"])  # explicit
    server = load_gateway_config(gateway_yaml(cm), tmp_path).server
    pod, container = gateway_pod(), gateway_container()
    # The kubelet SIGKILLs at the grace period: the drain and then the in-flight requests must fit.
    assert pod["terminationGracePeriodSeconds"] > server.drain_s + server.shutdown_timeout_s
    # While draining /ready is 503; the readiness probe must fail failureThreshold times (and at
    # least twice) inside drain_s, even when SIGTERM lands just after a successful probe.
    period, failures, timeout = probe_timing(container["readinessProbe"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert period * max(2, failures) + timeout <= server.drain_s
    # Liveness reads /health, which stays 200 while draining (asserted against a live gateway below).
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"


@contextlib.asynccontextmanager
async def serving(config: GatewayConfig) -> AsyncIterator[Gateway]:
    """The gateway as ``llm-gateway serve`` runs it, on a free port of 127.0.0.1."""
    app = build_app(config)
    port = free_port()
    runner = await start_site(
        app,
        "127.0.0.1",
        port,
        shutdown_timeout_s=1.0,
        max_header_bytes=config.server.max_header_bytes,
        max_headers=config.server.max_headers,
    )
    try:
        yield Gateway(f"http://127.0.0.1:{port}", app)
    finally:
        await runner.cleanup()


def localised(
    config: GatewayConfig, api_url: str, token: Path, keys: Path, redis: str, prefix: str
) -> GatewayConfig:
    """The production config with only the cluster's addresses replaced by local ones."""
    k8s = config.discovery.kubernetes
    assert k8s is not None
    local_k8s = k8s.model_copy(update={"api_server": api_url, "token_file": str(token), "ca_file": None})
    redis_update = {"redis_url": redis, "key_prefix": prefix}
    return config.model_copy(
        update={
            "discovery": config.discovery.model_copy(update={"kubernetes": local_k8s}),
            "prefix": config.prefix.model_copy(update=redis_update),
            "sessions": config.sessions.model_copy(update=redis_update),
            "auth": config.auth.model_copy(update={**redis_update, "keys_file": str(keys)}),
        }
    )


async def test_production_config_serves_discovered_pods_to_tenants(
    start_sim, http, tmp_path, redis_url, key_prefix
):
    """configmap.yaml's config as deployed; only the API server, token, keys file and Redis are local."""
    sim = await start_sim(model="m")
    token = tmp_path / "token"
    token.write_text("sa-token")
    keys_file, raw_keys = filled_keys(tmp_path)
    admin_key = "admin-deploy-test"
    (admin_env,) = [
        e["name"]
        for e in gateway_container()["env"]
        if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "llm-gateway-admin-key"
    ]
    config = load_gateway_config(production_yaml(), tmp_path, {admin_env: hash_key(admin_key)})
    k8s = config.discovery.kubernetes
    assert k8s is not None
    labels = {key: value for key, op, value in selector_terms(k8s.label_selector) if op != "!="}
    port = sim.url.rsplit(":", 1)[1]
    async with running_apiserver(k8s.namespace) as api:
        api.put(
            make_pod(
                "vllm-0",
                "127.0.0.1",
                labels=labels,
                annotations={k8s.port_annotation: port},
                namespace=k8s.namespace,
            )
        )
        local = localised(config, api.url, token, keys_file, redis_url, key_prefix)
        async with serving(local) as gw:

            async def ready() -> bool:
                async with http.get(gw.url + "/ready") as resp:
                    return resp.status == 200

            await wait_until(ready, 5.0, "the discovered pod to make the gateway ready")
            assert api.lists and api.lists[-1].authorization == "Bearer sa-token"

            # Tenants from the keys Secret, through the real OpenAI client.
            for key in raw_keys:
                async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0) as client:
                    reply = await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                    )
                    assert reply.choices[0].message.content
            async with openai.AsyncOpenAI(
                base_url=gw.url + "/v1", api_key="sk-unknown", max_retries=0
            ) as client:
                with pytest.raises(openai.AuthenticationError):
                    await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                    )
            async with http.post(gw.url + "/v1/chat/completions", json=chat_body("m")) as resp:
                assert resp.status == 401
            # The tenants' limits were counted in the shared Redis (limits_backend: redis).
            client = aioredis.from_url(redis_url)
            try:
                limit_keys = [k async for k in client.scan_iter(match=f"{key_prefix}:ratelimit:*")]
            finally:
                await client.aclose()
            assert limit_keys

            # The admin API: open to the key whose hash the Deployment's env carries, closed otherwise.
            admin = {"Authorization": f"Bearer {admin_key}"}
            async with http.get(gw.url + "/admin/endpoints", headers=admin) as resp:
                assert resp.status == 200
                (row,) = (await resp.json())["endpoints"]
            assert row["url"] == sim.url and row["source"].startswith("kubernetes")
            async with http.get(
                gw.url + "/admin/endpoints", headers={"Authorization": "Bearer nope"}
            ) as resp:
                assert resp.status == 401

            # Draining (what SIGTERM starts): the readiness path fails, the liveness path does not.
            gw.state.shutting_down = True
            container = gateway_container()
            async with http.get(gw.url + container["readinessProbe"]["httpGet"]["path"]) as resp:
                assert resp.status == 503
            async with http.get(gw.url + container["livenessProbe"]["httpGet"]["path"]) as resp:
                assert resp.status == 200


def test_keda_scaledobject_uses_desired_replicas():
    (scaled,) = [d for d in k8s_docs() if d["kind"] == "ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    # Replica-count gauge: AverageValue, threshold 1 gives replicas = ceil(gauge).
    assert trigger["metricType"] == "AverageValue" and trigger["metadata"]["threshold"] == "1"
    assert "llm_gateway_pool_desired_replicas" in trigger["metadata"]["query"]
    assert trigger["metadata"]["serverAddress"].startswith("http")


# --- All manifests, examples included: schemas and cross-references ---------------------------

K8S_VERSION = "1.30.0"  # a version kubernetes-validate ships strict schemas for
# Custom resources are not in the Kubernetes schema set: their apiVersion and required fields.
CRD_REQUIRED = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ("selector", "endpoints"),
    ("keda.sh/v1alpha1", "ScaledObject"): ("scaleTargetRef", "triggers"),
}
EXAMPLES = K8S / "examples"


def all_k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    """Every document under deploy/k8s, examples included, with the file it came from."""
    out = []
    for path in sorted(K8S.rglob("*.yaml")):
        out.extend((path, d) for d in yaml.safe_load_all(path.read_text()) if d is not None)
    return out


def docs_in(path: Path) -> list[dict[str, Any]]:
    return [d for p, d in all_k8s_docs() if p == path]


def test_expected_manifest_files_exist():
    names = {p.relative_to(K8S).as_posix() for p, _ in all_k8s_docs()}
    assert {
        "servicemonitor.yaml",
        "secret-api-keys.yaml",
        "rbac-discovery.yaml",
        "examples/vllm-pd-fleet.yaml",
        "examples/hpa-external.yaml",
    } <= names


@pytest.mark.parametrize(
    ("path", "doc"),
    all_k8s_docs(),
    ids=[f"{p.relative_to(K8S).as_posix()}:{d['kind']}/{d['metadata']['name']}" for p, d in all_k8s_docs()],
)
def test_manifest_validates(path, doc):
    key = (doc["apiVersion"], doc["kind"])
    if doc["kind"] in {k for _, k in CRD_REQUIRED}:
        assert key in CRD_REQUIRED, f"{path}: unexpected apiVersion {doc['apiVersion']} for {doc['kind']}"
        assert doc["metadata"]["name"] and doc["metadata"]["namespace"] == "llm-gateway"
        for field in CRD_REQUIRED[key]:
            assert doc["spec"].get(field), f"{path}: {doc['kind']}.spec.{field} missing"
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_manifest_validation_rejects_bad_documents():
    # The strict check really checks: an unknown field and a wrong type both fail.
    dep = copy.deepcopy(one("Deployment", "llm-gateway"))
    dep["spec"]["replicaz"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
    dep = copy.deepcopy(one("Deployment", "llm-gateway"))
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def test_all_namespaced_objects_in_gateway_namespace():
    for path, doc in all_k8s_docs():
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "llm-gateway", f"{path}: {doc['kind']}"


def test_servicemonitor_scrapes_gateway_service_port():
    (monitor,) = [d for _, d in all_k8s_docs() if d["kind"] == "ServiceMonitor"]
    svc = one("Service", "llm-gateway")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    # It must not also select the Redis Service.
    redis_labels = one("Service", "llm-gateway-redis")["metadata"]["labels"]
    assert not monitor["spec"]["selector"]["matchLabels"].items() <= redis_labels.items()
    assert svc["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in port_names
    assert endpoint["path"] == "/metrics"


def test_secrets_are_placeholders_and_match_deployment(tmp_path):
    secrets = {d["metadata"]["name"]: d for d in docs_in(K8S / "secret-api-keys.yaml")}
    assert set(secrets) == {"llm-gateway-api-keys", "llm-gateway-admin-key", "llm-gateway-session-secret"}
    for secret in secrets.values():
        assert secret["kind"] == "Secret" and "data" not in secret
        assert all("REPLACE_ME" in v for v in secret["stringData"].values())
    # Every Secret the Deployment reads into its environment exists with that key, and each variable
    # lands in the config field it is meant for.
    env = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in gateway_container()["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    expected = {
        "LLM_GATEWAY_SESSIONS__TOKEN_SECRET": (
            "llm-gateway-session-secret",
            lambda c: c.sessions.token_secret,
        ),
        "LLM_GATEWAY_AUTH__ADMIN_KEY_SHA256": ("llm-gateway-admin-key", lambda c: c.auth.admin_key_sha256),
    }
    assert set(env) == set(expected)
    value = hash_key("a-secret-value")
    for name, (secret, field) in expected.items():
        ref = env[name]
        assert ref["name"] == secret and ref["key"] in secrets[secret]["stringData"]
        assert ref["optional"] is True  # the pod starts without it; that feature stays off
        assert field(load_gateway_config(production_yaml(), tmp_path)) is None
        assert field(load_gateway_config(production_yaml(), tmp_path, {name: value})) == value


def test_keys_secret_template_is_a_keys_file(tmp_path):
    template = tmp_path / "template.yaml"
    template.write_text(keys_template())
    # As shipped the placeholders are refused, so nobody runs on them by accident.
    with pytest.raises(KeyFileError, match="sha256"):
        load_keys_file(template)
    path, raw_keys = filled_keys(tmp_path)
    keys = load_keys_file(path)
    assert set(keys) == {hash_key(k) for k in raw_keys} and len(raw_keys) >= 2
    assert {t.name for t in keys.values()} == set(yaml.safe_load(keys_template())["tenants"])


def test_documented_hash_command_matches_the_gateway():
    text = (K8S / "secret-api-keys.yaml").read_text()
    (command,) = re.findall(r'^#\s+(printf %s "\$KEY" \| sha256sum[^#\n]*?)\s*(?:#.*)?$', text, re.M)
    key = "sk-deploy test ✓"  # a space and non-ASCII: the command must hash the UTF-8 bytes, as the gateway
    result = subprocess.run(
        ["bash", "-c", command], env={**os.environ, "KEY": key}, capture_output=True, text=True, timeout=10
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == hash_key(key)


def test_keys_secret_mounted_where_auth_reads_it(tmp_path):
    keys_file = load_gateway_config(production_yaml(), tmp_path).auth.keys_file
    pod, container = gateway_pod(), gateway_container()
    (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "llm-gateway-api-keys"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    secret_keys = one("Secret", "llm-gateway-api-keys")["stringData"]
    files = {i["key"]: i["path"] for i in volume["secret"].get("items", [])} or {k: k for k in secret_keys}
    assert set(files) <= set(secret_keys)
    assert posixpath.join(mount["mountPath"], files["keys.yaml"]) == keys_file
    assert mount["readOnly"] is True
    # A subPath mount never sees Secret updates; a directory mount is swapped in place by the kubelet.
    assert "subPath" not in mount and "subPathExpr" not in mount
    # Not nested in (or over) another volume's mount, such as the ConfigMap's /etc/llm-gateway.
    for other in container["volumeMounts"]:
        if other is not mount:
            a, b = other["mountPath"].rstrip("/") + "/", mount["mountPath"].rstrip("/") + "/"
            assert not (a.startswith(b) or b.startswith(a)), other
    # Readable by the gateway's group (the kubelet gives Secret files the pod's fsGroup), not by others.
    mode = volume["secret"].get("defaultMode", 0o644)
    security = pod["securityContext"]
    assert mode & 0o040 and not mode & 0o007 and security["fsGroup"] == security["runAsGroup"]


def test_service_account_token_mounted_for_discovery(tmp_path):
    k8s = load_gateway_config(production_yaml(), tmp_path).discovery.kubernetes
    assert k8s is not None and k8s.api_server is None  # in-cluster: token and CA from the pod's mount
    assert posixpath.dirname(k8s.token_file) == SA_DIR
    assert k8s.ca_file is not None and posixpath.dirname(k8s.ca_file) == SA_DIR
    pod = gateway_pod()
    # The pod's own setting overrides the ServiceAccount's (which keeps automount off for others).
    assert pod["automountServiceAccountToken"] is True
    # Nothing else is mounted over the token's directory.
    for mount in gateway_container()["volumeMounts"]:
        path = mount["mountPath"].rstrip("/")
        assert not (SA_DIR + "/").startswith(path + "/"), mount


def test_discovery_rbac_binds_gateway_service_account(tmp_path):
    docs = {d["kind"]: d for d in docs_in(K8S / "rbac-discovery.yaml")}
    role, binding = docs["Role"], docs["RoleBinding"]
    (rule,) = role["rules"]
    assert rule["apiGroups"] == [""]
    assert set(rule["resources"]) == {"pods"}  # discovery reads pods, nothing else
    assert set(rule["verbs"]) == {"get", "list", "watch"}  # read-only; list + watch are what it uses
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    sa = one("ServiceAccount", "llm-gateway")
    gateway_sa = gateway_pod()["serviceAccountName"]
    (subject,) = binding["subjects"]
    assert subject == {"kind": "ServiceAccount", "name": gateway_sa, "namespace": sa["metadata"]["namespace"]}
    # Granted in the namespace discovery watches.
    k8s = load_gateway_config(production_yaml(), tmp_path).discovery.kubernetes
    assert k8s is not None
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == k8s.namespace


def pd_fleet() -> list[dict[str, Any]]:
    return docs_in(EXAMPLES / "vllm-pd-fleet.yaml")


def test_pd_fleet_pools():
    docs = pd_fleet()
    deployments = {
        d["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"]: d
        for d in docs
        if d["kind"] == "Deployment"
    }
    assert set(deployments) == {"prefill", "decode"}
    services = [d for d in docs if d["kind"] == "Service"]
    for role, dep in deployments.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["metadata"]["labels"]["llm-d.ai/role"] == role
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
        # The selector separates the pools.
        assert dep["spec"]["selector"]["matchLabels"]["llm-d.ai/role"] == role
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        assert container["image"].startswith("vllm/vllm-openai")
        args = container["args"]
        kv = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "NixlConnector"
        (svc,) = [s for s in services if s["spec"]["selector"].items() <= labels.items()]
        assert svc["spec"]["clusterIP"] == "None"  # headless
        assert svc["spec"]["selector"]["llm-d.ai/role"] == role
        port_names = {p["name"] for p in container["ports"]}
        assert all(p["targetPort"] in port_names for p in svc["spec"]["ports"])


def test_pd_fleet_gateway_config_builds(tmp_path, in_cluster):
    docs = pd_fleet()
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    # Drop-in for configmap.yaml: the name the gateway Deployment mounts.
    assert cm["metadata"]["name"] == one("ConfigMap", "llm-gateway-config")["metadata"]["name"]
    config = load_gateway_config(gateway_yaml(cm), tmp_path)
    assert config.pd.protocol == "vllm" and config.pd.decider == "prefix-aware"
    # Only routing differs from configmap.yaml: shutdown, resilience, Redis and auth stay as deployed.
    base = load_gateway_config(production_yaml(), tmp_path)
    for section in ("server", "resilience", "prefix", "sessions", "auth", "discovery"):
        assert getattr(config, section) == getattr(base, section), section
    assert set(yaml.safe_load(gateway_yaml(cm))) == set(yaml.safe_load(production_yaml())) | {
        "pd",
        "autoscale",
    }
    # Discovery turns each Ready pod of the fleet into an endpoint with its pool's role and port.
    k8s = config.discovery.kubernetes
    assert config.endpoints == [] and k8s is not None
    roles = set()
    for dep in (d for d in docs if d["kind"] == "Deployment"):
        template = dep["spec"]["template"]
        labels = template["metadata"]["labels"]
        assert selector_matches(k8s.label_selector, labels) and dep["metadata"]["namespace"] == k8s.namespace
        (container,) = template["spec"]["containers"]
        http_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
        pod = make_pod(
            f"{dep['metadata']['name']}-abc12",
            "10.244.1.7",
            labels=labels,
            annotations=template["metadata"].get("annotations"),
            namespace=k8s.namespace,
        )
        endpoint = endpoint_from_pod(pod, k8s)
        assert not isinstance(endpoint, Skip), endpoint
        assert endpoint.url == f"http://10.244.1.7:{http_port}"
        assert endpoint.role == labels["llm-d.ai/role"] and endpoint.engine == "vllm"
        roles.add(endpoint.role)
    assert roles == {"prefill", "decode"}
    keys_file, _ = filled_keys(tmp_path)
    build_app(with_keys_file(config, keys_file))


def test_pd_autoscaling_examples():
    docs = docs_in(EXAMPLES / "hpa-external.yaml")
    fleet = {d["metadata"]["name"]: d for d in pd_fleet() if d["kind"] == "Deployment"}
    (hpa,) = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = fleet[hpa["spec"]["scaleTargetRef"]["name"]]
    assert target["metadata"]["labels"]["llm-d.ai/role"] == "decode"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "llm_gateway_pool_desired_replicas"
    assert metric["external"]["metric"]["selector"]["matchLabels"] == {"pool": "decode"}
    # The gauge is a replica count: AverageValue 1 makes replicas = ceil(gauge).
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}

    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    target = fleet[scaled["spec"]["scaleTargetRef"]["name"]]
    assert target["metadata"]["labels"]["llm-d.ai/role"] == "prefill"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert 'llm_gateway_pool_desired_replicas{pool="prefill"}' in trigger["metadata"]["query"]
    # No Deployment is scaled by two autoscalers.
    targets = [
        d["spec"]["scaleTargetRef"]["name"]
        for _, d in all_k8s_docs()
        if "scaleTargetRef" in d.get("spec", {})
    ]
    assert len(targets) == len(set(targets))
