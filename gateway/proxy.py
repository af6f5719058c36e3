"""Sends a scheduled request upstream and streams the answer back, chunk by chunk.

Rules (DESIGN.md, issue 2):
- connect failure or 5xx *before the first byte* → re-send to the next-best endpoint
  (never the same one), up to ``limits.retries`` times;
- after the first byte the response is committed: an upstream failure ends the SSE
  stream with an error event and ``data: [DONE]`` instead of hanging;
- a client disconnect cancels the handler (``handler_cancellation``); ``finally``
  closes the upstream connection, which makes the engine abort the request and free
  its KV blocks, and releases every counter.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from gateway.config import LimitConfig, TimeoutConfig
from gateway.errors import EndpointUnavailable, UpstreamError, UpstreamTimeout, error_body
from gateway.metrics import GatewayMetrics
from gateway.pd import PD_DECISION, PD_STATE, PDCoordinator, PDLeg
from gateway.resilience import CircuitBreakers, RetryBudget, backoff_s
from gateway.types import ApiKind, Endpoint, InferenceRequest, SchedulingResult
from gateway.upstream import ConnectFailed, ConnectionLost, UpstreamClient, UpstreamResponse

__all__ = ["STREAM_STARTED", "Proxy", "RequestHooks", "extract_usage"]

T = TypeVar("T")

log = logging.getLogger(__name__)

_SSE_DONE = b"data: [DONE]\n\n"
_FORWARDED_RESPONSE_HEADERS = ("content-type",)


class RequestHooks:
    """Hooks around each upstream attempt (in-flight accounting, prefix index updates).

    ``on_send`` runs when a request is sent to an endpoint; ``on_first_byte`` when its
    first response chunk arrives; ``on_usage`` when the response carried a ``usage``
    object; ``on_done`` when the attempt ends for any reason, cancellation included.
    """

    def on_send(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        pass

    def on_first_byte(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        pass

    def on_usage(
        self, request: InferenceRequest, endpoint: Endpoint, prompt_tokens: int, cached_tokens: int
    ) -> None:
        pass

    def on_done(self, request: InferenceRequest, endpoint: Endpoint, ok: bool) -> None:
        pass


_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def extract_usage(payload: bytes) -> tuple[int, int] | None:
    """(prompt_tokens, cached_tokens) from the tail of a response, without parsing it all."""
    prompt = _PROMPT_TOKENS.findall(payload)
    if not prompt:
        return None
    cached = _CACHED_TOKENS.findall(payload)
    return int(prompt[-1]), int(cached[-1]) if cached else 0


_MAX_HELD_BYTES = 16384


async def _read_past_role_chunk(request: InferenceRequest, upstream: UpstreamResponse) -> bytes:
    """The first chunk of a stream; for chat, held until it carries more than the role.

    vLLM and SGLang open a chat stream with ``delta: {"role": "assistant", "content": ""}``
    before any token exists. Committing the client's response on that chunk would make
    a replica dying during prefill a mid-stream failure; holding it keeps the request
    retryable until a real token (or the end) arrives.
    """
    chunk = await upstream.readany()
    if request.api is not ApiKind.CHAT or b'"role"' not in chunk or not _only_role(chunk):
        return chunk
    held = bytearray(chunk)
    while len(held) < _MAX_HELD_BYTES:
        more = await upstream.readany()
        if not more:
            break
        held += more
        if not _only_role(bytes(held)):
            break
    return bytes(held)


def _only_role(buffer: bytes) -> bool:
    """True while every complete SSE event so far is a role-only chat delta (nothing to show yet)."""
    *events, _incomplete_tail = buffer.split(b"\n\n")
    for event in events:
        event = event.strip()
        if not event.startswith(b"data:"):
            return False
        try:
            payload = json.loads(event[5:])
        except ValueError:
            return False
        if not isinstance(payload, dict) or payload.get("usage"):
            return False
        for choice in payload.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
                return False
            delta = choice.get("delta")
            if not isinstance(delta, dict) or any(v for k, v in delta.items() if k != "role"):
                return False
    return True


def _aborted(body: bytes) -> bool:
    """Every choice of a completed (non-streamed) response ended with ``finish_reason: "abort"``."""
    try:
        choices = json.loads(body).get("choices")
    except (ValueError, AttributeError):
        return False
    return (
        isinstance(choices, list)
        and bool(choices)
        and all(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices)
    )


@dataclass(frozen=True, slots=True)
class _Attempt:
    started: float  # time.monotonic() at arrival, for latency metrics
    deadline: float  # loop time by which the whole request must end


# Set on the aiohttp request once response headers went out: from then on no error
# response can be sent, only an in-band SSE error event.
STREAM_STARTED: web.RequestKey[bool] = web.RequestKey("stream_started", bool)


# Retry reasons that say nothing against the endpoint tried: its prefill partner failed,
# or it was already ejected while the request waited.
_NOT_THE_ENDPOINTS_FAULT = frozenset({"prefill_failed", "ejected"})


class _Retryable(Exception):
    def __init__(self, reason: str, response: web.Response | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response


class Proxy:
    def __init__(
        self,
        client: UpstreamClient,
        timeouts: TimeoutConfig,
        limits: LimitConfig,
        metrics: GatewayMetrics,
        hooks: RequestHooks,
        on_connect_failure: Callable[[Endpoint], None] | None = None,
        endpoint_headers: Callable[[InferenceRequest, Endpoint], dict[str, str]] | None = None,
        pd: PDCoordinator | None = None,
        breakers: CircuitBreakers | None = None,
        retry_budget: RetryBudget | None = None,
        retry_backoff_s: float = 0.0,
    ) -> None:
        self._client = client
        self._timeouts = timeouts
        self._limits = limits
        self._metrics = metrics
        self._hooks = hooks
        self._on_connect_failure = on_connect_failure
        self._endpoint_headers = endpoint_headers
        self._pd = pd
        self._breakers = breakers
        self._retry_budget = retry_budget
        self._retry_backoff_s = retry_backoff_s

    def reconfigure(
        self, timeouts: TimeoutConfig, limits: LimitConfig, retry_budget: RetryBudget, retry_backoff_s: float
    ) -> None:
        """Hot reload: requests already running keep the deadline they started with."""
        self._timeouts = timeouts
        self._limits = limits
        self._retry_budget = retry_budget
        self._retry_backoff_s = retry_backoff_s

    async def forward(
        self,
        http_request: web.Request,
        request: InferenceRequest,
        result: SchedulingResult,
        extra_headers: dict[str, str],
    ) -> web.StreamResponse:
        ranked = [s.endpoint for s in result.ranked]
        attempts = ranked[: 1 + self._limits.retries]
        last_failure: _Retryable | None = None
        loop = asyncio.get_running_loop()
        # One hard deadline for the whole request; every wait below is capped by it,
        # so a committed stream still ends cleanly (error event + [DONE]) at the limit.
        attempt = _Attempt(started=time.monotonic(), deadline=loop.time() + self._timeouts.total_s)
        prefill = result.prefill_ranked
        self._count_pd_decision(request, prefill is not None)
        # A failed prefill leg is not the decode replica's fault: the pair is re-sent with
        # the same decode replica and the next prefill replica (or decode-only at the end).
        budget = len(attempts) + (len(prefill) if prefill else 0)
        if self._retry_budget is not None:
            self._retry_budget.record_request()
        index = 0
        retry_number = 0
        while index < len(attempts) and budget > 0:
            endpoint = attempts[index]
            budget -= 1
            if last_failure is not None:
                if not await self._may_retry(attempt, retry_number := retry_number + 1):
                    break
                self._metrics.retries.labels(last_failure.reason).inc()
                log.info(
                    "request %s: retrying on %s (%s)", request.request_id, endpoint.name, last_failure.reason
                )
            leg = None
            if prefill is not None and self._pd is not None:  # a fresh prefill for every decode attempt
                leg = await self._pd.prepare(request, [s.endpoint for s in prefill], self._limits.retries)
                request.attributes[PD_STATE] = leg
            try:
                body = leg.decode_body if leg is not None else request.raw_body
                return await self._attempt(http_request, request, endpoint, extra_headers, attempt, body)
            except _Retryable as failure:
                last_failure = failure
                if failure.reason != "prefill_failed":
                    index += 1
            finally:
                if self._pd is not None:
                    await self._pd.finish(leg)
        assert last_failure is not None
        if last_failure.response is not None:
            return last_failure.response  # the last upstream's own 5xx, passed through
        raise EndpointUnavailable(
            f"no endpoint could be reached for model {request.model!r} ({last_failure.reason})",
            code="upstream_unavailable",
        )

    async def _may_retry(self, attempt: _Attempt, retry_number: int) -> bool:
        """Spend from the retry budget, then back off (full jitter) within the deadline."""
        if self._retry_budget is not None and not self._retry_budget.try_spend():
            self._metrics.retry_budget_exhausted.inc()
            return False
        if self._retry_backoff_s > 0:
            loop = asyncio.get_running_loop()
            delay = min(backoff_s(self._retry_backoff_s, retry_number), attempt.deadline - loop.time())
            if delay > 0:
                await asyncio.sleep(delay)
        return True

    def _count_pd_decision(self, request: InferenceRequest, disaggregated: bool) -> None:
        decision = request.attributes.get(PD_DECISION)
        if decision is not None:
            mode = "disaggregated" if disaggregated else "decode_only"
            self._metrics.child(self._metrics.pd_decisions, mode, decision[1]).inc()

    async def _attempt(
        self,
        http_request: web.Request,
        request: InferenceRequest,
        endpoint: Endpoint,
        extra_headers: dict[str, str],
        attempt: _Attempt,
        body: bytes,
    ) -> web.StreamResponse:
        self._hooks.on_send(request, endpoint)
        if self._breakers is not None:
            self._breakers.on_send(endpoint)
        request.attributes["endpoint"] = endpoint.name
        ok = False
        verdict: str | None = None  # "ok", or the endpoint's failure; None: not its fault
        upstream: UpstreamResponse | None = None
        try:
            upstream = await self._unless_prefill_fails(request, self._open(request, endpoint, attempt, body))
            headers = {"x-gateway-endpoint": endpoint.name, **extra_headers}
            if self._endpoint_headers is not None:
                headers.update(self._endpoint_headers(request, endpoint))
            if upstream.status >= 500:
                raise await self._server_error(endpoint, upstream, headers, attempt)
            if request.stream and upstream.status == 200:
                response, complete = await self._stream(
                    http_request, request, endpoint, upstream, headers, attempt
                )
            else:
                response = await self._buffered(request, endpoint, upstream, headers, attempt)
                complete = True
            ok = complete and upstream.status < 400
            verdict = "ok" if complete else "mid_stream"
            self._metrics.child(
                self._metrics.requests, request.model, endpoint.name, str(response.status)
            ).inc()
            return response
        except _Retryable as failure:
            if failure.reason not in _NOT_THE_ENDPOINTS_FAULT:
                verdict = failure.reason
            raise
        except UpstreamTimeout:
            verdict = "timeout"
            raise
        except UpstreamError:
            verdict = "upstream_error"
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            self._metrics.client_disconnects.inc()  # the client went away; finally frees the replica
            raise
        finally:
            if self._breakers is not None:
                if verdict is None:
                    self._breakers.release_probe(endpoint)  # no verdict: let another request probe
                elif verdict == "ok":
                    self._breakers.on_success(endpoint)
                else:
                    self._breakers.on_failure(endpoint, verdict)
            if upstream is not None:
                # Not a clean end (error, timeout, client gone): close the socket so the
                # engine sees the disconnect and frees the request's KV cache.
                if ok:
                    upstream.release()
                else:
                    upstream.close()
            self._hooks.on_done(request, endpoint, ok)

    def _wait_limit(self, attempt: _Attempt, budget_s: float) -> float:
        """Absolute loop time to stop waiting: ``budget_s`` from now, never past the deadline."""
        return min(asyncio.get_running_loop().time() + budget_s, attempt.deadline)

    async def _open(
        self, request: InferenceRequest, endpoint: Endpoint, attempt: _Attempt, body: bytes
    ) -> UpstreamResponse:
        headers = {"content-type": "application/json", "x-request-id": request.request_id}
        if endpoint.auth_header is not None:
            headers["authorization"] = endpoint.auth_header
        wait = None
        try:
            async with asyncio.timeout_at(self._wait_limit(attempt, self._timeouts.first_byte_s)) as limit:
                if self._breakers is None:
                    return await self._client.post(endpoint.url, request.api.upstream_path, body, headers)
                with self._breakers.first_byte_wait(endpoint, limit, queued=True) as wait:
                    return await self._client.post(
                        endpoint.url, request.api.upstream_path, body, headers, on_slot=wait.restart
                    )
        except TimeoutError:
            if wait is not None and wait.aborted is not None:
                raise _Retryable(wait.aborted) from None  # ejected while we waited: re-send elsewhere
            self._metrics.upstream_errors.labels(endpoint.name, "timeout").inc()
            raise UpstreamTimeout(f"endpoint {endpoint.name} did not answer in time") from None
        except ConnectFailed as exc:
            self._metrics.upstream_errors.labels(endpoint.name, "connect").inc()
            if self._on_connect_failure:
                self._on_connect_failure(endpoint)
            raise _Retryable("connect") from exc
        except ConnectionLost as exc:  # accepted, then closed before any response byte
            self._metrics.upstream_errors.labels(endpoint.name, "disconnected").inc()
            raise _Retryable("disconnected") from exc

    async def _server_error(
        self,
        endpoint: Endpoint,
        upstream: UpstreamResponse,
        headers: dict[str, str],
        attempt: _Attempt,
    ) -> _Retryable:
        """A 5xx before the first byte: retryable; keep its body to pass on if no retry succeeds."""
        reason = f"http_{upstream.status}"
        self._metrics.upstream_errors.labels(endpoint.name, reason).inc()
        try:
            async with asyncio.timeout_at(self._wait_limit(attempt, self._timeouts.first_byte_s)):
                body = await upstream.read()
        except (TimeoutError, ConnectionLost):
            return _Retryable(reason)  # its body stalled or broke: nothing worth passing on
        headers["content-type"] = upstream.content_type
        return _Retryable(reason, web.Response(status=upstream.status, body=body, headers=headers))

    async def _buffered(
        self,
        request: InferenceRequest,
        endpoint: Endpoint,
        upstream: UpstreamResponse,
        headers: dict[str, str],
        attempt: _Attempt,
    ) -> web.Response:
        try:
            async with asyncio.timeout_at(self._wait_limit(attempt, self._timeouts.first_byte_s)):
                body = await upstream.read()
        except TimeoutError:
            raise UpstreamTimeout("upstream response body timed out") from None
        except ConnectionLost as exc:
            raise UpstreamError(f"upstream failed while sending its response: {exc}") from None
        if upstream.status == 200 and b'"abort"' in body and _aborted(body):
            # vLLM shutting down answers in-flight requests 200 with finish_reason "abort" and
            # a truncated text. Nothing reached the client yet: re-send it elsewhere.
            self._metrics.upstream_errors.labels(endpoint.name, "aborted").inc()
            raise _Retryable("aborted")
        self._hooks.on_first_byte(request, endpoint)
        if self._breakers is not None:
            self._breakers.on_first_byte(endpoint)
        request.attributes["ttft_ms"] = round((time.monotonic() - attempt.started) * 1000, 2)
        if upstream.status == 200:
            self._report_usage(request, endpoint, body[-2048:])
        headers["content-type"] = upstream.content_type  # passed through verbatim, charset included
        response = web.Response(status=upstream.status, body=body, headers=headers)
        elapsed = time.monotonic() - attempt.started
        self._metrics.child(self._metrics.ttft, request.model).observe(elapsed)
        self._metrics.child(self._metrics.e2e, request.model).observe(elapsed)
        return response

    async def _stream(
        self,
        http_request: web.Request,
        request: InferenceRequest,
        endpoint: Endpoint,
        upstream: UpstreamResponse,
        headers: dict[str, str],
        attempt: _Attempt,
    ) -> tuple[web.StreamResponse, bool]:
        """Pipe the SSE stream; returns the response and whether it ended cleanly.

        The client's response is committed only when the first chunk is in hand: until
        then a broken upstream (or, for SGLang P/D, a failed prefill leg) is retryable.
        """
        first_chunk = await self._first_chunk(request, endpoint, upstream, attempt)
        headers["content-type"] = upstream.headers.get("content-type", "text/event-stream")
        headers["cache-control"] = "no-cache"
        response = web.StreamResponse(status=200, headers=headers)
        await response.prepare(http_request)
        http_request[STREAM_STARTED] = True
        first = True
        pending_first = first_chunk
        failure: str | None = None
        read_chunk = upstream.readany
        idle_s = self._timeouts.idle_s
        previous = last = b""  # the usage object sits in the last chunks of the stream
        try:
            async with asyncio.timeout_at(self._wait_limit(attempt, self._timeouts.first_byte_s)) as limit:
                while True:
                    if pending_first is not None:
                        chunk, pending_first = pending_first, None
                    else:
                        try:
                            chunk = await read_chunk()
                        except ConnectionLost as exc:
                            failure = f"upstream stream broke: {exc}"
                            break
                    if not chunk:
                        break
                    await response.write(chunk)  # a client that left raises here, on purpose
                    previous, last = last, chunk
                    if first:
                        first = False
                        ttft = time.monotonic() - attempt.started
                        self._metrics.child(self._metrics.ttft, request.model).observe(ttft)
                        request.attributes["ttft_ms"] = round(ttft * 1000, 2)
                        self._hooks.on_first_byte(request, endpoint)
                    limit.reschedule(self._wait_limit(attempt, idle_s))
        except TimeoutError:
            failure = "upstream stalled: no data within the idle or total timeout"
        if failure is not None:
            log.warning("request %s: %s", request.request_id, failure)
            self._metrics.upstream_errors.labels(endpoint.name, "mid_stream").inc()
            event = error_body(failure, "upstream_error", "upstream_stream_error")
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n" + _SSE_DONE)
        else:
            self._report_usage(request, endpoint, previous[-2048:] + last[-2048:])
        await response.write_eof()
        self._metrics.child(self._metrics.e2e, request.model).observe(time.monotonic() - attempt.started)
        return response, failure is None

    async def _first_chunk(
        self, request: InferenceRequest, endpoint: Endpoint, upstream: UpstreamResponse, attempt: _Attempt
    ) -> bytes:
        wait = None
        try:
            async with asyncio.timeout_at(self._wait_limit(attempt, self._timeouts.first_byte_s)) as limit:
                if self._breakers is None:
                    return await self._unless_prefill_fails(request, _read_past_role_chunk(request, upstream))
                with self._breakers.first_byte_wait(endpoint, limit) as wait:
                    chunk = await self._unless_prefill_fails(
                        request, _read_past_role_chunk(request, upstream)
                    )
                self._breakers.on_first_byte(endpoint)
                return chunk
        except TimeoutError:
            if wait is not None and wait.aborted is not None:
                raise _Retryable(wait.aborted) from None
            raise UpstreamTimeout("upstream sent headers but no data in time") from None
        except ConnectionLost as exc:
            raise _Retryable("disconnected") from exc

    async def _unless_prefill_fails(self, request: InferenceRequest, wait: Coroutine[Any, Any, T]) -> T:
        """Await ``wait``, unless a concurrent SGLang prefill leg fails first: then re-send the pair."""
        leg: PDLeg | None = request.attributes.get(PD_STATE)
        prefill = leg.task if leg is not None else None
        if prefill is None or prefill.done():
            return await wait
        waiting = asyncio.ensure_future(wait)
        try:
            await asyncio.wait((waiting, prefill), return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done() and leg is not None and leg.failed:
                raise _Retryable("prefill_failed")
            return await waiting
        finally:
            if not waiting.done():
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)

    def _report_usage(self, request: InferenceRequest, endpoint: Endpoint, tail: bytes) -> None:
        usage = extract_usage(tail)
        if usage is not None:
            self._hooks.on_usage(request, endpoint, *usage)
            completion = _COMPLETION_TOKENS.findall(tail)
            request.attributes["usage"] = (usage[0], int(completion[-1]) if completion else 0)
