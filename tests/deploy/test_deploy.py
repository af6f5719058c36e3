"""Deployment artifacts: the Grafana dashboard, Prometheus rules and Kubernetes manifests.

Metric names are checked against what a real gateway exports, so a renamed metric breaks a test
instead of a dashboard panel.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import build_app
from gateway.config import load_config
from tests.gateway.harness import chat_body, gateway_metrics

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
    if importlib.util.find_spec("gateway.autoscale") is None:
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
async def exported(start_sim, start_gateway, http) -> set[str]:
    sims = [await start_sim(model="m"), await start_sim(model="m")]
    gw = await start_gateway([s.url for s in sims])
    for stream in (False, True, False, True):
        async with http.post(gw.url + "/v1/chat/completions", json=chat_body("m", stream=stream)) as resp:
            assert resp.status == 200
            await resp.read()
    return exported_sample_names(await gateway_metrics(http, gw))


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
    if importlib.util.find_spec("gateway.autoscale") is not None:
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
    assert len(alerts) == 5


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


def test_configmap_gateway_config_builds(tmp_path):
    raw = one("ConfigMap", "llm-gateway-config")["data"]["gateway.yaml"]
    path = tmp_path / "gateway.yaml"
    path.write_text(raw)
    config = load_config(path, environ={})
    example = yaml.safe_load((ROOT / "deploy" / "examples" / "gateway.yaml").read_text())
    assert set(example) <= set(yaml.safe_load(raw))  # same structure as the documented example
    redis_host = one("Service", "llm-gateway-redis")["metadata"]["name"]
    assert config.prefix.backend == "redis" and config.sessions.backend == "redis"
    assert f"//{redis_host}." in config.prefix.redis_url and f"//{redis_host}." in config.sessions.redis_url
    assert config.server.port == 8080 and len(config.endpoints) >= 1
    build_app(config)  # wiring validation; Redis is contacted only at startup


def test_keda_scaledobject_uses_desired_replicas():
    (scaled,) = [d for d in k8s_docs() if d["kind"] == "ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert "llm_gateway_pool_desired_replicas" in trigger["metadata"]["query"]
    assert trigger["metadata"]["serverAddress"].startswith("http")
