"""Deployment artifacts: the Grafana dashboard, Prometheus rules and Kubernetes manifests.

Metric names are checked against what a real gateway exports, so a renamed metric breaks a test
instead of a dashboard panel.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
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


def test_secrets_are_placeholders_and_match_deployment():
    secrets = {d["metadata"]["name"]: d for d in docs_in(K8S / "secret-api-keys.yaml")}
    assert set(secrets) == {"llm-gateway-api-keys", "llm-gateway-session-secret"}
    for secret in secrets.values():
        assert secret["kind"] == "Secret" and "data" not in secret
        assert all("REPLACE_ME" in v for v in secret["stringData"].values())
    # The key the Deployment reads exists in the session Secret.
    (container,) = one("Deployment", "llm-gateway")["spec"]["template"]["spec"]["containers"]
    refs = [
        e["valueFrom"]["secretKeyRef"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})
    ]
    ref = next(r for r in refs if r["name"] == "llm-gateway-session-secret")
    assert ref["key"] in secrets["llm-gateway-session-secret"]["stringData"]


def test_discovery_rbac_binds_gateway_service_account():
    docs = {d["kind"]: d for d in docs_in(K8S / "rbac-discovery.yaml")}
    role, binding = docs["Role"], docs["RoleBinding"]
    (rule,) = role["rules"]
    assert rule["apiGroups"] == [""]
    assert set(rule["resources"]) == {"pods", "endpoints"}
    assert set(rule["verbs"]) == {"get", "list", "watch"}  # read-only
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    sa = one("ServiceAccount", "llm-gateway")
    gateway_sa = one("Deployment", "llm-gateway")["spec"]["template"]["spec"]["serviceAccountName"]
    (subject,) = binding["subjects"]
    assert subject == {"kind": "ServiceAccount", "name": gateway_sa, "namespace": sa["metadata"]["namespace"]}


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


def test_pd_fleet_gateway_config_builds(tmp_path):
    docs = pd_fleet()
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    # Drop-in for configmap.yaml: the name the gateway Deployment mounts.
    assert cm["metadata"]["name"] == one("ConfigMap", "llm-gateway-config")["metadata"]["name"]
    path = tmp_path / "gateway.yaml"
    path.write_text(cm["data"]["gateway.yaml"])
    config = load_config(path, environ={})
    assert config.pd.protocol == "vllm" and config.pd.decider == "prefix-aware"
    roles = {e.role for e in config.endpoints}
    assert {"prefill", "decode"} <= roles
    # Every endpoint URL names a pool Service of the fleet, with the Service's port and role.
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for endpoint in config.endpoints:
        host, port = endpoint.url.split("://", 1)[1].split(":")
        svc = services[host.split(".")[0]]
        assert int(port) in {p["port"] for p in svc["spec"]["ports"]}
        assert svc["spec"]["selector"]["llm-d.ai/role"] == endpoint.role
    build_app(config)


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
