"""Prefill/decode disaggregation on the wire: the engines' own protocols.

- **vLLM NixlConnector**: leg 1 sends the prompt to a prefill replica with
  ``max_tokens: 1``, ``stream: false`` and ``kv_transfer_params.do_remote_decode``; its
  answer carries ``kv_transfer_params`` (engine id, block ids, host, port) that leg 2
  hands to the decode replica with the client's original body, so the decode replica
  pulls the KV blocks instead of recomputing the prompt.
- **SGLang bootstrap**: both replicas get the same body plus ``bootstrap_host``,
  ``bootstrap_port`` (the prefill replica's) and a random 63-bit ``bootstrap_room``,
  concurrently; the decode replica streams.

A disaggregation that silently degrades — a prefill answer without transfer params, or
a decode replica whose usage shows it recomputed the prompt — is counted and logged:
users otherwise lose the benefit of P/D without noticing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway.config import PDConfig
from gateway.errors import UpstreamError
from gateway.metrics import GatewayMetrics
from gateway.prefix.cache import PrefixCache
from gateway.types import Endpoint, InferenceRequest
from gateway.upstream import ConnectFailed, ConnectionLost, UpstreamClient

__all__ = ["PD_DECISION", "PD_STATE", "PDCoordinator", "PDLeg"]

log = logging.getLogger(__name__)

PD_STATE = "pd_leg"  # request attribute: the PDLeg of the current decode attempt
PD_DECISION = "pd_decision"  # request attribute: (disaggregate: bool, reason: str), set by the handler
_FAILED_PREFILL = "pd_failed_prefill"  # request attribute: prefill endpoints that failed it
_PREFILL_DROP = ("stream_options", "min_tokens", "min_completion_tokens")
_EMPTY_TRANSFER = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(slots=True)
class PDLeg:
    """What the prefill leg produced for one decode attempt."""

    decode_body: bytes
    prefill_endpoint: Endpoint
    prefill_done_at: float | None = None  # monotonic; None while an SGLang prefill runs
    task: asyncio.Task[None] | None = None  # SGLang: the concurrent prefill request
    failed: bool = False  # SGLang: the concurrent prefill failed


class PDCoordinator:
    def __init__(
        self, client: UpstreamClient, config: PDConfig, metrics: GatewayMetrics, prefix: PrefixCache
    ) -> None:
        self._client = client
        self._config = config
        self._metrics = metrics
        self._prefix = prefix

    async def prepare(
        self, request: InferenceRequest, prefill_ranked: Sequence[Endpoint], retries: int
    ) -> PDLeg | None:
        """Run (vLLM) or start (SGLang) the prefill leg; None means decode-only (fallback)."""
        failed: set[Endpoint] = request.attributes.setdefault(_FAILED_PREFILL, set())
        untried = [e for e in prefill_ranked if e not in failed]
        for endpoint in untried[: 1 + retries]:
            if self._config.protocol == "sglang":
                return self._start_sglang(request, endpoint)
            leg = await self._vllm_prefill(request, endpoint)
            if leg is not None:
                return leg
            failed.add(endpoint)
        if not self._config.fallback_to_decode:
            raise UpstreamError("prefill failed on every prefill replica", code="prefill_failed")
        self._metrics.child(self._metrics.pd_decisions, "decode_only", "prefill_failed").inc()
        log.warning("request %s: prefill failed everywhere; serving decode-only", request.request_id)
        return None

    # -- vLLM NixlConnector -------------------------------------------------------------
    def _vllm_prefill_body(self, request: InferenceRequest) -> bytes:
        body = {k: v for k, v in request.body.items() if k not in _PREFILL_DROP}
        body["stream"] = False
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body["kv_transfer_params"] = dict(_EMPTY_TRANSFER)
        return json.dumps(body, separators=(",", ":")).encode()

    async def _vllm_prefill(self, request: InferenceRequest, endpoint: Endpoint) -> PDLeg | None:
        started = time.monotonic()
        payload = await self._post(request, endpoint, self._vllm_prefill_body(request))
        if payload is None:
            return None
        try:
            params = json.loads(payload).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            self._degraded(request, "no_transfer_params", endpoint)
            return None
        self._metrics.child(self._metrics.pd_leg_duration, "prefill").observe(time.monotonic() - started)
        body = dict(request.body)
        body["kv_transfer_params"] = params
        decode_body = json.dumps(body, separators=(",", ":")).encode()
        return PDLeg(decode_body, endpoint, prefill_done_at=time.monotonic())

    async def _post(self, request: InferenceRequest, endpoint: Endpoint, body: bytes) -> bytes | None:
        """One prefill request, with the gateway's own accounting for the prefill replica."""
        pending = self._prefix.uncached_tokens(request, endpoint)
        endpoint.in_flight += 1
        endpoint.pending_prefill_tokens += pending
        self._prefix.record(request, endpoint)
        response = None
        try:
            async with asyncio.timeout(self._config.prefill_timeout_s):
                response = await self._client.post(
                    endpoint.url, request.api.upstream_path, body, {"x-request-id": request.request_id}
                )
                payload = await response.read()
            if response.status != 200:
                self._metrics.child(self._metrics.pd_prefill_failures, f"http_{response.status}").inc()
                return None
            response.release()
            response = None
            return payload
        except TimeoutError:
            self._metrics.child(self._metrics.pd_prefill_failures, "timeout").inc()
            return None
        except (ConnectFailed, ConnectionLost):
            self._metrics.child(self._metrics.pd_prefill_failures, "connect").inc()
            return None
        finally:
            if response is not None:
                response.close()
            endpoint.in_flight -= 1
            endpoint.pending_prefill_tokens = max(0.0, endpoint.pending_prefill_tokens - pending)

    # -- SGLang bootstrap ---------------------------------------------------------------
    def _start_sglang(self, request: InferenceRequest, endpoint: Endpoint) -> PDLeg:
        body = dict(request.body)
        body["bootstrap_host"] = urlsplit(endpoint.url).hostname
        body["bootstrap_port"] = endpoint.bootstrap_port
        body["bootstrap_room"] = secrets.randbits(63)
        raw = json.dumps(body, separators=(",", ":")).encode()
        leg = PDLeg(raw, endpoint)
        leg.task = asyncio.get_running_loop().create_task(self._sglang_prefill(request, leg))
        return leg

    async def _sglang_prefill(self, request: InferenceRequest, leg: PDLeg) -> None:
        started = time.monotonic()
        prefill_body = json.loads(leg.decode_body)
        prefill_body["stream"] = False
        prefill_body.pop("stream_options", None)
        payload = await self._post(request, leg.prefill_endpoint, json.dumps(prefill_body).encode())
        if payload is None:
            leg.failed = True
            request.attributes.setdefault(_FAILED_PREFILL, set()).add(leg.prefill_endpoint)
            self._degraded(request, "prefill_failed", leg.prefill_endpoint)
            return
        leg.prefill_done_at = time.monotonic()
        self._metrics.child(self._metrics.pd_leg_duration, "prefill").observe(leg.prefill_done_at - started)

    # -- proof ----------------------------------------------------------------------
    def decode_first_byte(self, request: InferenceRequest) -> None:
        leg: PDLeg | None = request.attributes.get(PD_STATE)
        if leg is not None and leg.prefill_done_at is not None:
            transfer = max(0.0, time.monotonic() - leg.prefill_done_at)
            self._metrics.pd_kv_transfer.observe(transfer)

    def decode_usage(self, request: InferenceRequest, prompt_tokens: int, cached_tokens: int) -> None:
        """The decode replica should report (nearly) the whole prompt as not computed by it."""
        leg: PDLeg | None = request.attributes.get(PD_STATE)
        if leg is not None and prompt_tokens > 0 and cached_tokens < prompt_tokens // 2:
            self._degraded(request, "recomputed", leg.prefill_endpoint)

    def _degraded(self, request: InferenceRequest, reason: str, endpoint: Endpoint) -> None:
        self._metrics.child(self._metrics.pd_degraded, reason).inc()
        log.warning(
            "request %s: P/D degraded (%s) with prefill replica %s", request.request_id, reason, endpoint.name
        )

    async def finish(self, leg: PDLeg | None) -> None:
        """Cancel an SGLang prefill still running (client gone, decode failed)."""
        if leg is not None and leg.task is not None and not leg.task.done():
            leg.task.cancel()
            await asyncio.gather(leg.task, return_exceptions=True)
