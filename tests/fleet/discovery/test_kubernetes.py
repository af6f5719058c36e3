"""Kubernetes discovery against a real HTTP server speaking the API's LIST + WATCH protocol."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import ssl
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import ConfigError, DiscoveryConfig, EndpointConfig, KubernetesDiscoveryConfig
from gateway.fleet.discovery import build_sources
from gateway.fleet.discovery.kubernetes import KubernetesSource
from tests.fleet.discovery.apiserver import FakeApiServer, make_pod, running_apiserver
from tests.fleet.discovery.conftest import Recorder

SELECTOR = "app=vllm,tier=inference"
FIXTURE = Path(__file__).with_name("watch_stream.jsonl")


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with running_apiserver("llm") as server:
        yield server


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("token-one\n")
    return path


def source_for(
    api: FakeApiServer, token: Path, backoff: tuple[float, float] = (0.02, 0.2), **overrides: Any
) -> KubernetesSource:
    settings: dict[str, Any] = {
        "namespace": "llm",
        "label_selector": SELECTOR,
        "api_server": api.url,
        "token_file": str(token),
        "ca_file": None,
        "resync_s": 30.0,
        **overrides,
    }
    config = KubernetesDiscoveryConfig(**settings)
    return KubernetesSource(config, backoff_initial_s=backoff[0], backoff_max_s=backoff[1])


def pod(name: str, ip: str | None = "10.244.0.10", port: str | None = "8000", **kw: Any) -> dict[str, Any]:
    labels = {"tier": "inference", **kw.pop("labels", {})}
    annotations = {"llm-gateway.io/port": port} if port else {}
    annotations.update(kw.pop("annotations", {}))
    return make_pod(name, ip, labels=labels, annotations=annotations, **kw)


async def test_initial_list_applies_the_ready_pods_with_their_settings(
    api: FakeApiServer, token: Path, recorder: Recorder, run_source
) -> None:
    api.put(pod("plain", "10.244.0.10"))
    api.put(pod("fallback-port", "10.244.0.11", port=None))  # no annotation: config port 9000
    api.put(pod("llmd-prefill", "10.244.0.12", labels={"llm-d.ai/role": "prefill"}))
    api.put(
        pod(
            "ours-wins",
            "10.244.0.13",
            labels={
                "llm-gateway.io/role": "decode",
                "llm-d.ai/role": "prefill",
                "llm-gateway.io/engine": "sglang",
                "llm-gateway.io/model": "qwen3-0.6b",
            },
        )
    )
    api.put(pod("v6", "fd00:10:244::7", annotations={"llm-gateway.io/model": "Qwen/Qwen3-0.6B, qwen3"}))
    api.put(pod("bad-port", "10.244.0.25", port="http"))
    api.put(pod("not-ready", "10.244.0.20", ready=False))
    api.put(pod("no-ip-yet", None))
    api.put(pod("terminating", "10.244.0.21", deleting=True))
    api.put(pod("bad-role", "10.244.0.22", labels={"llm-d.ai/role": "encode"}))
    api.put(pod("bad-engine", "10.244.0.23", labels={"llm-gateway.io/engine": "tgi"}))
    api.put(pod("other-tier", "10.244.0.24", labels={"tier": "batch"}))  # outside the selector

    source = source_for(api, token, port=9000)
    assert source.name == f"kubernetes:llm/{SELECTOR}"
    run_source(source, recorder)
    await recorder.wait_for(lambda eps: True, what="the first apply")

    assert [name for name, _ in recorder.calls] == [source.name]
    got = recorder.by_url()
    assert set(got) == {
        "http://10.244.0.10:8000",
        "http://10.244.0.11:9000",
        "http://10.244.0.12:8000",
        "http://10.244.0.13:8000",
        "http://[fd00:10:244::7]:8000",
    }
    assert got["http://10.244.0.10:8000"] == EndpointConfig(
        url="http://10.244.0.10:8000",
        labels={"app": "vllm", "tier": "inference", "pod": "plain"},
    )
    assert got["http://10.244.0.12:8000"].role == "prefill"
    ours = got["http://10.244.0.13:8000"]
    assert (ours.role, ours.engine, ours.models) == ("decode", "sglang", ["qwen3-0.6b"])
    assert ours.labels["pod"] == "ours-wins"
    assert got["http://[fd00:10:244::7]:8000"].models == ["Qwen/Qwen3-0.6B", "qwen3"]  # from the annotation

    await api.wait_watching()
    listed, watched = api.lists[0], api.watches[0]
    assert listed.query == {"labelSelector": SELECTOR}
    assert watched.query["labelSelector"] == SELECTOR
    assert watched.query["resourceVersion"] == str(api.version)
    assert (watched.query["watch"], watched.query["allowWatchBookmarks"]) == ("1", "true")
    assert {r.authorization for r in api.requests} == {"Bearer token-one"}


async def test_watch_events_add_and_remove_endpoints(
    api: FakeApiServer, token: Path, recorder: Recorder, run_source
) -> None:
    api.put(pod("a", "10.0.0.1"))
    api.put(pod("b", "10.0.0.2", ready=False))
    api.put(pod("c", "10.0.0.3"))
    api.put(pod("d", "10.0.0.4"))
    api.put(pod("e", "10.0.0.5"))
    run_source(source_for(api, token), recorder)
    await recorder.wait_urls({f"http://10.0.0.{i}:8000" for i in (1, 3, 4, 5)})
    await api.wait_watching()

    api.put(pod("b", "10.0.0.2"))  # turns Ready
    await recorder.wait_for(lambda eps: "http://10.0.0.2:8000" in {e.url for e in eps}, what="b added")
    api.put(pod("a", "10.0.0.1", ready=False))  # NotReady
    await recorder.wait_for(lambda eps: "http://10.0.0.1:8000" not in {e.url for e in eps}, what="a removed")
    api.put(pod("c", "10.0.0.3", deleting=True))  # still Ready, but terminating
    await recorder.wait_for(lambda eps: "http://10.0.0.3:8000" not in {e.url for e in eps}, what="c removed")
    api.delete("d")
    await recorder.wait_for(lambda eps: "http://10.0.0.4:8000" not in {e.url for e in eps}, what="d removed")
    api.put(pod("e", "10.0.0.5", labels={"tier": "batch"}))  # leaves the selector: the watch says DELETED
    await recorder.wait_urls({"http://10.0.0.2:8000"})
    api.put(pod("f", "10.0.0.6", port=None))  # no port anywhere: skipped
    big = pod("g", "10.0.0.7")
    big["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"] = "x" * 700_000
    api.put(big)  # one event line above aiohttp's 512 KiB readline limit (etcd allows 1.5 MiB objects)
    await recorder.wait_urls({"http://10.0.0.2:8000", "http://10.0.0.7:8000"})
    api.bookmark()
    api.delete("b")
    api.delete("g")
    await recorder.wait_for(lambda eps: eps == [], what="the last pod deleted → empty set")

    sets = [{e.url for e in eps} for _, eps in recorder.calls]
    assert all(a != b for a, b in itertools.pairwise(sets)), "apply is called only on a change"
    assert len(api.lists) == 1 and len(api.watches) == 1, "every change came through the one watch"


async def test_410_gone_relists_and_rewatches_from_the_new_version(
    api: FakeApiServer, token: Path, recorder: Recorder, run_source, caplog: pytest.LogCaptureFixture
) -> None:
    api.put(pod("a", "10.0.0.1"))
    api.put(pod("b", "10.0.0.2"))
    run_source(source_for(api, token), recorder)
    await recorder.wait_urls({"http://10.0.0.1:8000", "http://10.0.0.2:8000"})
    await api.wait_watching()

    api.delete("a", notify=False)  # changes the watch never delivers: only a LIST can see them
    api.put(pod("c", "10.0.0.3"), notify=False)
    api.expire()  # ERROR 410 on the open watch; the old version stays too old to watch from
    await recorder.wait_urls({"http://10.0.0.2:8000", "http://10.0.0.3:8000"})
    await api.wait_watching(watch_requests=2)
    assert len(api.lists) == 2
    assert int(api.watches[1].query["resourceVersion"]) >= api.compacted
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "410 is routine, not an error"


async def test_a_watch_that_is_always_gone_backs_off_instead_of_relisting_in_a_loop(
    api: FakeApiServer, token: Path, recorder: Recorder, run_source
) -> None:
    api.put(pod("a", "10.0.0.1"))
    api.compacted = 10**9  # every watch is answered with 410 at once
    run_source(source_for(api, token), recorder)
    await recorder.wait_urls({"http://10.0.0.1:8000"})
    await asyncio.sleep(0.5)
    # back-off 0.02 → 0.2 s (±20 %): about six lists in 0.5 s; a hot loop would make hundreds
    assert 3 <= len(api.lists) <= 12, len(api.lists)
    assert [{e.url for e in eps} for _, eps in recorder.calls] == [{"http://10.0.0.1:8000"}]


async def test_dropped_watch_reconnects_with_a_fresh_list_and_the_current_token(
    api: FakeApiServer, token: Path, recorder: Recorder, run_source
) -> None:
    api.put(pod("a", "10.0.0.1"))
    run_source(source_for(api, token), recorder)
    await recorder.wait_urls({"http://10.0.0.1:8000"})
    await api.wait_watching()

    token.write_text("token-two\n")  # a projected token rotated
    api.put(pod("b", "10.0.0.2"), notify=False)
    api.drop()  # TCP connection aborted mid-stream
    await recorder.wait_urls({"http://10.0.0.1:8000", "http://10.0.0.2:8000"})
    await api.wait_watching(watch_requests=2)
    api.put(pod("c", "10.0.0.3"))  # the new watch delivers again
    await recorder.wait_urls({"http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"})
    assert [r.authorization for r in api.requests[:2]] == ["Bearer token-one"] * 2
    assert {r.authorization for r in api.requests[2:]} == {"Bearer token-two"}


async def test_resync_relists_even_when_the_watch_is_quiet(
    api: FakeApiServer, token: Path, recorder: Recorder, run_source
) -> None:
    api.honour_timeout = False  # the server would hold the watch open for ever: the source must let go
    api.put(pod("a", "10.0.0.1"))
    run_source(source_for(api, token, resync_s=0.3), recorder)
    await recorder.wait_urls({"http://10.0.0.1:8000"})
    await api.wait_watching()
    api.put(pod("b", "10.0.0.2"), notify=False)  # a missed event
    await recorder.wait_urls({"http://10.0.0.1:8000", "http://10.0.0.2:8000"}, within_s=0.8)
    assert len(api.lists) >= 2
    assert api.watches[0].query["timeoutSeconds"] == "1"  # and asks the server to end it near then too


async def test_errors_keep_the_last_set_and_back_off(
    api: FakeApiServer, token: Path, recorder: Recorder, run_source
) -> None:
    api.put(pod("a", "10.0.0.1"))
    api.put(pod("b", "10.0.0.2"))
    task = run_source(source_for(api, token, backoff=(0.01, 0.8)), recorder)
    good = await recorder.wait_urls({"http://10.0.0.1:8000", "http://10.0.0.2:8000"})
    await api.wait_watching()

    api.list_status = 500
    api.delete("a", notify=False)
    api.delete("b", notify=False)
    api.drop()
    await api.wait_lists(6)  # the first list, then five failed re-lists
    api.list_status = 403  # RBAC missing: also an error, never "no pods"
    await api.wait_lists(8)
    assert recorder.calls == [(recorder.calls[0][0], good)], "errors must not apply anything"
    assert not task.done()

    failed = [r.at for r in api.lists[1:8]]
    gaps = [b - a for a, b in itertools.pairwise(failed)]  # nominally 0.02, 0.04, … 0.32 (±20 %)
    assert gaps[-1] > gaps[0] * 4, f"back-off grows between failed lists: {gaps}"

    api.list_status = 200  # the API server is back, and really has no pods now
    await recorder.wait_for(lambda eps: eps == [], what="the authoritative empty list", within_s=5)
    await api.wait_watching(watch_requests=2)
    api.put(pod("c", "10.0.0.3"))  # a healthy watch again: the back-off starts over
    await recorder.wait_urls({"http://10.0.0.3:8000"})
    api.drop()
    dropped = time.monotonic()
    await api.wait_lists(10)
    assert api.lists[9].at - dropped < 0.3, "after a healthy watch the first retry is quick, not 0.8 s"


async def test_watch_error_event_other_than_410_relists_and_keeps_the_set(
    api: FakeApiServer, token: Path, recorder: Recorder, run_source
) -> None:
    api.put(pod("a", "10.0.0.1"))
    run_source(source_for(api, token), recorder)
    await recorder.wait_urls({"http://10.0.0.1:8000"})
    await api.wait_watching()
    status = (
        b'{"kind":"Status","apiVersion":"v1","status":"Failure","message":"etcd leader changed","code":500}'
    )
    api.send_raw(b'{"type":"ERROR","object":' + status + b"}")
    await api.wait_watching(watch_requests=2)
    assert len(api.lists) == 2
    assert [{e.url for e in eps} for _, eps in recorder.calls] == [{"http://10.0.0.1:8000"}]


async def test_no_matching_pods_is_an_authoritative_empty_set(
    api: FakeApiServer, token: Path, recorder: Recorder, run_source
) -> None:
    api.put(pod("other", "10.0.0.9", labels={"tier": "batch"}))
    run_source(source_for(api, token), recorder)
    await recorder.wait_for(lambda eps: eps == [], what="the first apply, empty")
    await api.wait_watching()
    api.put(pod("a", "10.0.0.1"))
    await recorder.wait_urls({"http://10.0.0.1:8000"})


async def test_recorded_llm_d_watch_stream(
    api: FakeApiServer, token: Path, recorder: Recorder, run_source
) -> None:
    """A watch stream of real-shaped llm-d pods: scheduled → IP → Ready, a prefill pod terminating,
    a bookmark, and a pod whose role the gateway does not know."""
    run_source(source_for(api, token, label_selector="", model_label="llm-d.ai/model"), recorder)
    await recorder.wait_for(lambda eps: eps == [], what="the empty initial list")
    await api.wait_watching()
    for line in FIXTURE.read_bytes().splitlines():
        api.send_raw(line)
    api.put(pod("sentinel", "10.99.0.1"))  # after every recorded line: once seen, all were handled
    await recorder.wait_for(lambda eps: "http://10.99.0.1:8000" in {e.url for e in eps}, what="sentinel")

    a, b, c = "http://10.52.3.17:8000", "http://10.52.1.9:8000", "http://10.52.2.23:8200"
    sets = [{e.url for e in eps} for _, eps in recorder.calls]
    assert sets[:-1] == [set(), {b}, {a, b}, {a, b, c}, {a, c}]
    final = recorder.by_url()
    for url, name in ((a, "qwen3-ms-decode-5b8f6d7c9-hx2kq"), (c, "qwen3-ms-decode-5b8f6d7c9-m4n7p")):
        assert (final[url].role, final[url].engine, final[url].models) == ("decode", "vllm", ["Qwen3-0.6B"])
        assert final[url].labels["pod"] == name
        assert final[url].labels["llm-d.ai/inferenceServing"] == "true"
    assert len(api.lists) == 1


# ---- in-cluster configuration over TLS ---------------------------------------------------


def _self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "apiserver.crt", directory / "apiserver.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=kubernetes"),
            *("-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
        timeout=20,
    )
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a test CA")
async def test_in_cluster_https_with_the_service_account_ca(
    tmp_path: Path, token: Path, recorder: Recorder, run_source
) -> None:
    cert, key = _self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    async with contextlib.AsyncExitStack() as stack:
        api = await stack.enter_async_context(running_apiserver("llm", ssl_context=tls))
        api.put(pod("a", "10.0.0.1"))
        host, port = api.url.removeprefix("https://").split(":")
        environ = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
        config = KubernetesDiscoveryConfig(
            namespace="llm", label_selector=SELECTOR, token_file=str(token), ca_file=str(cert)
        )
        task = run_source(KubernetesSource(config, environ=environ, backoff_initial_s=0.02), recorder)
        await recorder.wait_urls({"http://10.0.0.1:8000"})
        await api.wait_watching()
        assert api.requests[0].authorization == "Bearer token-one"

        # Without that CA (system CAs only) the handshake fails: nothing is requested, nothing applied.
        untrusted = Recorder()
        config = config.model_copy(update={"ca_file": None})
        other = run_source(KubernetesSource(config, environ=environ, backoff_initial_s=0.02), untrusted)
        await asyncio.sleep(0.3)
        assert untrusted.calls == [] and len(api.requests) == 2
        task.cancel()  # before the server stops: an open watch must not hold its shutdown
        other.cancel()


def test_outside_a_cluster_without_api_server_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="api_server"):
        KubernetesSource(KubernetesDiscoveryConfig(), environ={})


def test_build_sources_makes_one_source_per_authority(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    config = DiscoveryConfig(
        kubernetes=KubernetesDiscoveryConfig(namespace="llm", label_selector="app=vllm"),
        dns=[{"name": "vllm.llm.svc", "port": 8000}, {"name": "_http._tcp.sgl.llm.svc", "record": "SRV"}],
    )
    names = [source.name for source in build_sources(config)]
    assert names == ["kubernetes:llm/app=vllm", "dns:vllm.llm.svc", "dns:_http._tcp.sgl.llm.svc"]
    assert build_sources(DiscoveryConfig()) == []
