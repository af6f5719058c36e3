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
(``PDHook``) a decode replica whose usage shows it recomputed the prompt — is counted and
logged: users otherwise lose the benefit of P/D without noticing.

A prefill leg runs the prefill hook chain (in-flight and prefix accounting, the same
hooks as every decode attempt), so the prefill replica's load is seen at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

from gateway.config import PDConfig
from gateway.errors import GatewayError, UpstreamError, engine_error_message
from gateway.fleet.dp import RANK_HEADER, RANK_REFUSED, other_servers_first, rank_out_of_range, without_rank
from gateway.fleet.endpoint import Endpoint
from gateway.ops.metrics import GatewayMetrics
from gateway.proxy.attempt import Retryable
from gateway.proxy.hooks import Outcome, RequestHooks
from gateway.proxy.upstream import ConnectFailed, ConnectionLost, ResponseTooLarge, UpstreamClient
from gateway.request.types import InferenceRequest

__all__ = ["PDCoordinator", "PDLeg", "PDState", "PrefillRefused", "unless_prefill_fails"]

log = logging.getLogger(__name__)

# a prefill answer is one token and the KV transfer parameters: anything near this is broken
_MAX_PREFILL_ANSWER_BYTES = 16 * 1024 * 1024
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


@dataclass(slots=True)
class PDState:
    """A disaggregated request's prefill legs, in its context."""

    leg: PDLeg | None = None  # the leg of the current decode attempt
    failed_prefill: set[Endpoint] = field(default_factory=set)  # prefill endpoints that failed it
    deadline: float = math.inf  # loop time by which the whole request must end: bounds every leg
    refused: _Refused | None = None  # a prefill replica refused the request: no other leg is tried


# A prefill replica's answers that refuse the request itself (a prompt past the context window,
# a bad field): no other prefill replica would take it. 401/403 are the gateway's credentials
# to the replica: its fault, as a 5xx is.
_REFUSALS = frozenset({400, 413, 422})
_REPLICA_FAULTS = frozenset({401, 403})


class PrefillRefused(GatewayError):
    """Without ``fallback_to_decode``: a prefill replica's refusal of the request, worded as the
    engine worded it. (With it, the decode replica gets the client's own body and answers for
    itself: the refusal may be of the leg's changes, a one-token cap, not of the request.)
    Re-sent to every other prefill replica, it was a retryable 502 ``prefill_failed``."""

    error_type = "invalid_request_error"
    code = "prefill_refused"

    def __init__(self, status: int, payload: bytes) -> None:
        super().__init__(
            engine_error_message(payload) or f"the prefill replica refused the request ({status})"
        )
        self.status = status


class _RankRefused(Exception):
    """The prefill server has no such data-parallel rank (restarted with fewer)."""


class _Refused(Exception):
    """A prefill replica refused the request itself (see ``_REFUSALS``)."""

    def __init__(self, status: int, payload: bytes) -> None:
        super().__init__(status)
        self.status, self.payload = status, payload


class PDCoordinator:
    def __init__(self, client: UpstreamClient, config: PDConfig, metrics: GatewayMetrics) -> None:
        self._client = client
        self._config = config
        self._metrics = metrics
        # A prefill rank target's server refused its rank (wired to the fleet's events).
        self.on_rank_refused: Callable[[Endpoint], None] = lambda target: None

    async def prepare(
        self,
        request: InferenceRequest,
        prefill_ranked: Sequence[Endpoint],
        retries: int,
        hooks: RequestHooks,
        deadline: float = math.inf,
    ) -> PDLeg | None:
        """Run (vLLM) or start (SGLang) the prefill leg; None means decode-only (fallback).

        The leg becomes ``request.context.pd.leg`` (None when decode-only). No leg outlives
        ``deadline`` (the request's own, in loop time), whatever ``pd.prefill_timeout_s`` says."""
        state = request.context.pd
        if state is None:
            state = request.context.pd = PDState()
        state.leg = None
        state.deadline = deadline
        if state.refused is not None:  # by the leg of an earlier decode attempt (or SGLang's)
            return self._after_refusal(state.refused)
        # Another prefill server before another rank of one that failed (it fails on every rank).
        untried = [e for e in other_servers_first(prefill_ranked) if e not in state.failed_prefill]
        queue, index = untried[: 1 + retries], 0
        while index < len(queue):
            endpoint, index = queue[index], index + 1
            if self._config.protocol == "sglang":
                state.leg = self._start_sglang(request, endpoint, hooks)
                return state.leg
            try:
                leg = await self._vllm_prefill(request, endpoint, hooks)
            except _RankRefused:  # the same server next, without the header (vLLM picks the rank)
                queue[index:] = without_rank(endpoint, queue[index:])
                self.on_rank_refused(endpoint)
                continue
            except _Refused as refused:  # no other prefill replica would take it
                self._note_refusal(state, refused)
                return self._after_refusal(refused)
            if leg is not None:
                state.leg = leg
                return leg
            state.failed_prefill.add(endpoint)
        if not self._config.fallback_to_decode:
            raise UpstreamError("prefill failed on every prefill replica", code="prefill_failed")
        self._metrics.child(self._metrics.pd_decisions, "decode_only", "prefill_failed").inc()
        log.warning("request %s: prefill failed everywhere; serving decode-only", request.request_id)
        return None

    def _note_refusal(self, state: PDState, refused: _Refused) -> None:
        """No other prefill leg for this request, on any decode attempt; counted once."""
        state.refused = refused
        if self._config.fallback_to_decode:
            self._metrics.child(self._metrics.pd_decisions, "decode_only", "prefill_refused").inc()

    def _after_refusal(self, refused: _Refused) -> None:
        """Decode-only (the decode replica answers for itself), or without fallback the refusal."""
        if not self._config.fallback_to_decode:
            raise PrefillRefused(refused.status, refused.payload)

    # -- vLLM NixlConnector -------------------------------------------------------------
    def _vllm_prefill_body(self, request: InferenceRequest) -> bytes:
        body = {k: v for k, v in request.body.items() if k not in _PREFILL_DROP}
        body["stream"] = False
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body["kv_transfer_params"] = dict(_EMPTY_TRANSFER)
        return json.dumps(body, separators=(",", ":")).encode()

    async def _vllm_prefill(
        self, request: InferenceRequest, endpoint: Endpoint, hooks: RequestHooks
    ) -> PDLeg | None:
        started = time.monotonic()
        payload = await self._post(request, endpoint, self._vllm_prefill_body(request), hooks)
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

    async def _post(
        self, request: InferenceRequest, endpoint: Endpoint, body: bytes, hooks: RequestHooks
    ) -> bytes | None:
        """One prefill request, run through the prefill hook chain (the replica's accounting)."""
        hooks.on_send(request, endpoint)
        response = None
        verdict: str | None = None  # what the leg says of the replica (its breaker and health)
        try:
            loop = asyncio.get_running_loop()
            deadline = request.context.pd.deadline if request.context.pd is not None else math.inf
            own_limit = loop.time() + self._config.prefill_timeout_s
            async with asyncio.timeout_at(min(own_limit, deadline)):
                response = await self._client.post(
                    endpoint.url, request.api.upstream_path, body, _headers(request, endpoint)
                )
                payload = await response.read(_MAX_PREFILL_ANSWER_BYTES)
            if response.status != 200:
                rank = endpoint.dp_rank
                if response.status == 400 and rank is not None and rank_out_of_range(payload, rank):
                    self._metrics.child(self._metrics.pd_prefill_failures, RANK_REFUSED).inc()
                    raise _RankRefused
                self._metrics.child(self._metrics.pd_prefill_failures, f"http_{response.status}").inc()
                if response.status in _REFUSALS:
                    raise _Refused(response.status, payload)
                faulty = response.status >= 500 or response.status in _REPLICA_FAULTS
                verdict = f"http_{response.status}" if faulty else None  # else the request's
                return None
            response.release()
            response = None
            verdict = "ok"
            return payload
        except TimeoutError:
            self._metrics.child(self._metrics.pd_prefill_failures, "timeout").inc()
            verdict = "timeout" if own_limit <= deadline else None  # the request's deadline: not its fault
            return None
        except ConnectFailed:
            self._metrics.child(self._metrics.pd_prefill_failures, "connect").inc()
            verdict = "connect"
            return None
        except ConnectionLost:
            self._metrics.child(self._metrics.pd_prefill_failures, "connect").inc()
            verdict = "disconnected"
            return None
        except ResponseTooLarge:
            self._metrics.child(self._metrics.pd_prefill_failures, "too_large").inc()
            verdict = "upstream_error"
            return None
        finally:
            if response is not None:
                response.close()
            hooks.on_done(request, endpoint, Outcome(ok=verdict == "ok", verdict=verdict))

    # -- SGLang bootstrap ---------------------------------------------------------------
    def _start_sglang(self, request: InferenceRequest, endpoint: Endpoint, hooks: RequestHooks) -> PDLeg:
        body = dict(request.body)
        body["bootstrap_host"] = urlsplit(endpoint.url).hostname
        body["bootstrap_port"] = endpoint.bootstrap_port
        body["bootstrap_room"] = secrets.randbits(63)
        raw = json.dumps(body, separators=(",", ":")).encode()
        leg = PDLeg(raw, endpoint)
        leg.task = asyncio.get_running_loop().create_task(self._sglang_prefill(request, leg, hooks))
        return leg

    async def _sglang_prefill(self, request: InferenceRequest, leg: PDLeg, hooks: RequestHooks) -> None:
        started = time.monotonic()
        prefill_body = json.loads(leg.decode_body)
        prefill_body["stream"] = False
        prefill_body.pop("stream_options", None)
        try:
            payload = await self._post(
                request, leg.prefill_endpoint, json.dumps(prefill_body).encode(), hooks
            )
        except _Refused as refused:  # the decode leg waits for KV that will not come: a failed leg,
            leg.failed = True  # and the next attempt's prepare() answers for the refusal
            if request.context.pd is not None:
                self._note_refusal(request.context.pd, refused)
            return
        if payload is None:
            leg.failed = True
            if request.context.pd is not None:
                request.context.pd.failed_prefill.add(leg.prefill_endpoint)
            self._degraded(request, "prefill_failed", leg.prefill_endpoint)
            return
        leg.prefill_done_at = time.monotonic()
        self._metrics.child(self._metrics.pd_leg_duration, "prefill").observe(leg.prefill_done_at - started)

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


def _headers(request: InferenceRequest, endpoint: Endpoint) -> dict[str, str]:
    """A prefill leg carries the same credentials as any request to that endpoint."""
    headers = {"content-type": "application/json", "x-request-id": request.request_id}
    if endpoint.auth_header is not None:
        headers["authorization"] = endpoint.auth_header
    if endpoint.dp_rank is not None:  # a data-parallel rank target (fleet/dp.py)
        headers[RANK_HEADER] = str(endpoint.dp_rank)
    return headers


T = TypeVar("T")


def unless_prefill_fails(request: InferenceRequest, wait: Coroutine[Any, Any, T]) -> Awaitable[T]:
    """``wait`` (itself, without a running SGLang prefill leg), unless that leg fails first."""
    leg = request.context.pd.leg if request.context.pd is not None else None
    if leg is None or leg.task is None or leg.task.done():
        return wait
    return _race_prefill(wait, leg.task, leg)


async def _race_prefill(wait: Coroutine[Any, Any, T], prefill: asyncio.Task[None], leg: PDLeg) -> T:
    waiting = asyncio.ensure_future(wait)
    try:
        await asyncio.wait((waiting, prefill), return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done() and leg.failed:
            raise Retryable("prefill_failed")
        return await waiting
    finally:
        if not waiting.done():
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
