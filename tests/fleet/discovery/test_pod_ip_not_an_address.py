"""A pod's ``status.podIP`` that is not an IP address must not become an endpoint.

Found by review (2026-12-05); failed on the code before the fix.
"""

from __future__ import annotations

import socket

import pytest

from gateway.config import DiscoveryConfig, KubernetesDiscoveryConfig
from gateway.fleet.discovery import build_sources
from tests.fleet.discovery.apiserver import make_pod, running_apiserver
from tests.fleet.discovery.conftest import Recorder

METADATA_FORMS = ["2852039166", "0251.0376.0251.0376", "169.254.43518", "0xa9fea9fe"]


@pytest.mark.parametrize("pod_ip", METADATA_FORMS)
async def test_a_pod_ip_that_resolves_to_the_metadata_service_is_refused(
    pod_ip: str, tmp_path, recorder: Recorder, run_source
) -> None:
    # What the gateway's connections would reach:
    assert socket.getaddrinfo(pod_ip, 80, type=socket.SOCK_STREAM)[0][4][0] == "169.254.169.254"
    token = tmp_path / "token"
    token.write_text("t")
    async with running_apiserver("llm") as api:
        api.put(make_pod("good", "10.244.0.7", annotations={"llm-gateway.io/port": "8000"}))
        api.put(make_pod("evil", pod_ip, annotations={"llm-gateway.io/port": "80"}))
        config = DiscoveryConfig(
            kubernetes=KubernetesDiscoveryConfig(
                namespace="llm", api_server=api.url, token_file=str(token), ca_file=None
            )
        )  # defaults: no allow-list, allow_link_local false
        [source] = build_sources(config)
        run_source(source, recorder)
        await recorder.wait_for(lambda eps: any(e.url == "http://10.244.0.7:8000" for e in eps))
        assert recorder.urls == {"http://10.244.0.7:8000"}, (
            f"a pod IP of {pod_ip!r} (= 169.254.169.254) joined the fleet: {recorder.urls}"
        )
