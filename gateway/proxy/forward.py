"""Sends a scheduled request upstream and streams the answer back, chunk by chunk.

Rules:
- connect failure or 5xx *before the first byte* → re-send to the next-best endpoint
  (never the same one), up to ``limits.retries`` times, within the retry budget;
- after the first byte the response is committed: an upstream failure ends the SSE
  stream with an error event and ``data: [DONE]`` instead of hanging;
- a client disconnect cancels the handler (``handler_cancellation``); ``finally``
  closes the upstream connection, which makes the engine abort the request and free
  its KV blocks, and the hook chain releases every counter.

The body sent upstream is the client's body as parsed (the handler may have rewritten
fields, e.g. the engine priority; a P/D decode leg adds the transfer parameters).
Everything done *because* an attempt went to an endpoint lives in the hook chain
(:mod:`gateway.proxy.hooks`); this module only moves bytes and decides retries.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial

from aiohttp import HttpVersion11, web

from gateway.errors import GATEWAY_CUT, EndpointUnavailable, UpstreamError, UpstreamTimeout
from gateway.fleet.dp import RANK_HEADER, RANK_REFUSED, other_servers_first, rank_out_of_range, without_rank
from gateway.fleet.endpoint import Endpoint
from gateway.ops.metrics import GatewayMetrics
from gateway.proxy.attempt import Attempt, ProxySettings, Retryable, lost_before_answer, sending
from gateway.proxy.hooks import HookSet, Outcome
from gateway.proxy.limits import wait_limit
from gateway.proxy.pd import PDCoordinator, unless_prefill_fails
from gateway.proxy.relay import StreamRelay
from gateway.proxy.resilience import CircuitBreakers, backoff_s
from gateway.proxy.sse import (
    aborted,
    ends_event,
    error_event,
    read_past_role_chunk,
)
from gateway.proxy.typed_events import event_buffer, stream_end
from gateway.proxy.upstream import (
    ConnectFailed,
    ConnectionLost,
    ResponseTooLarge,
    UpstreamClient,
    UpstreamResponse,
)
from gateway.proxy.usage import report_usage
from gateway.request.types import InferenceRequest
from gateway.scheduling.result import SchedulingResult

__all__ = ["STREAM_STARTED", "Proxy", "ProxySettings"]

log = logging.getLogger(__name__)

# Set on the aiohttp request once response headers went out: from then on no error
# response can be sent, only an in-band SSE error event.
STREAM_STARTED: web.RequestKey[bool] = web.RequestKey("stream_started", bool)

# Retry reasons that say nothing against the endpoint tried: its prefill partner failed,
# it was already ejected while the request waited, or it has no such rank (fleet/dp.py).
_NOT_THE_ENDPOINTS_FAULT = frozenset({"prefill_failed", "ejected", RANK_REFUSED})
_ERROR_BODY_WAIT_S = 2.0  # a 5xx's body, kept to pass on if no retry succeeds: at most this long
_ERROR_BODY_MAX = 65536  # and this large


class Proxy:
    def __init__(
        self,
        client: UpstreamClient,
        settings: ProxySettings,
        metrics: GatewayMetrics,
        breakers: CircuitBreakers,
        pd: PDCoordinator,
        after_request: Callable[[Endpoint], None] | None = None,
        on_rank_refused: Callable[[Endpoint], None] | None = None,
    ) -> None:
        """Hooks: ``after_request(endpoint)`` at each attempt's end; ``on_rank_refused(target)``."""
        self._client = client
        self._after_request = after_request
        self._on_rank_refused = on_rank_refused or (lambda target: None)
        self.settings = settings
        self._metrics = metrics
        self._breakers = breakers
        self._pd = pd

    def reconfigure(self, settings: ProxySettings) -> None:
        """Hot reload: the next request uses ``settings``."""
        self.settings = settings

    async def forward(
        self,
        http_request: web.Request,
        request: InferenceRequest,
        result: SchedulingResult,
        extra_headers: dict[str, str],
        hooks: HookSet,
    ) -> web.StreamResponse:
        settings = self.settings
        ranked = [s.endpoint for s in result.ranked]
        attempts = other_servers_first(ranked)[: 1 + settings.limits.retries]
        last_failure: Retryable | None = None
        loop = asyncio.get_running_loop()
        # One hard deadline for the whole request; every wait below is capped by it,
        # so a committed stream still ends cleanly (error event + [DONE]) at the limit.
        attempt = Attempt(time.monotonic(), loop.time() + settings.timeouts.total_s, settings, hooks.attempt)
        prefill = result.prefill_ranked
        self._count_pd_decision(request, prefill is not None)
        # A failed prefill leg is not the decode replica's fault: the pair is re-sent with
        # the same decode replica and the next prefill replica (or decode-only at the end).
        budget = len(attempts) + (len(prefill) if prefill else 0)
        settings.retry_budget.record_request()
        index = 0
        retry_number = 0
        while index < len(attempts) and budget > 0:
            endpoint = attempts[index]
            budget -= 1
            if last_failure is not None:
                if not await self._may_retry(attempt, retry_number := retry_number + 1, last_failure):
                    break
                self._metrics.retries.labels(last_failure.reason).inc()
                log.info(
                    "request %s: retrying on %s (%s)", request.request_id, endpoint.name, last_failure.reason
                )
            leg = None
            if prefill is not None:  # a fresh prefill for every decode attempt
                prefill_endpoints = [s.endpoint for s in prefill]
                retries, deadline = settings.limits.retries, attempt.deadline
                leg = await self._pd.prepare(request, prefill_endpoints, retries, hooks.prefill, deadline)
            try:
                body = leg.decode_body if leg is not None else request.raw_body
                return await self._attempt(http_request, request, endpoint, extra_headers, attempt, body)
            except Retryable as failure:
                last_failure = failure
                if failure.reason == RANK_REFUSED:
                    attempts[index + 1 :] = without_rank(endpoint, attempts[index + 1 :])
                    budget += 1
                    self._on_rank_refused(endpoint)
                if failure.reason != "prefill_failed":
                    index += 1
            finally:
                await self._pd.finish(leg)
        assert last_failure is not None
        if last_failure.response is not None:
            return last_failure.response  # the last upstream's own 5xx, passed through
        if loop.time() >= attempt.deadline:
            raise UpstreamTimeout(f"the request's total timeout passed ({last_failure.reason})")
        raise EndpointUnavailable(
            f"no endpoint could be reached for model {request.model!r} ({last_failure.reason})",
            code="upstream_unavailable",
        )

    async def _may_retry(self, attempt: Attempt, retry_number: int, failure: Retryable) -> bool:
        """Spend from the retry budget, then back off (full jitter) within the deadline.

        Never once the deadline has passed: a re-send with no time left would time out at
        once and be charged to an endpoint it never reached. A refused rank's re-send is free."""
        loop = asyncio.get_running_loop()
        if loop.time() >= attempt.deadline:
            return False
        if failure.reason == RANK_REFUSED:
            return True
        if not attempt.settings.retry_budget.try_spend():
            self._metrics.retry_budget_exhausted.inc()
            return False
        if attempt.settings.retry_backoff_s > 0:
            delay = min(
                backoff_s(attempt.settings.retry_backoff_s, retry_number), attempt.deadline - loop.time()
            )
            if delay > 0:
                await asyncio.sleep(delay)
        return loop.time() < attempt.deadline

    def _count_pd_decision(self, request: InferenceRequest, disaggregated: bool) -> None:
        decision = request.context.pd_decision
        if decision is not None:
            mode = "disaggregated" if disaggregated else "decode_only"
            self._metrics.child(self._metrics.pd_decisions, mode, decision.reason).inc()

    async def _attempt(
        self,
        http_request: web.Request,
        request: InferenceRequest,
        endpoint: Endpoint,
        extra_headers: dict[str, str],
        attempt: Attempt,
        body: bytes,
    ) -> web.StreamResponse:
        hooks = attempt.hooks
        hooks.on_send(request, endpoint)
        request.context.endpoint = endpoint.name
        ok = False
        verdict: str | None = None  # "ok", or the endpoint's failure; None: not its fault
        upstream: UpstreamResponse | None = None
        try:
            upstream = await unless_prefill_fails(request, self._open(request, endpoint, attempt, body))
            headers = {"x-gateway-endpoint": endpoint.name, **extra_headers}
            hooks.on_headers(request, endpoint, headers)
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
        except Retryable as failure:
            if failure.reason not in _NOT_THE_ENDPOINTS_FAULT:
                verdict = failure.reason
            raise
        except UpstreamTimeout:
            verdict = "timeout"
            raise
        except UpstreamError:
            verdict = "upstream_error"
            raise
        except asyncio.CancelledError as exc:
            if GATEWAY_CUT not in exc.args:  # not the gateway's own cut (shutdown): the client left
                self._metrics.client_disconnects.inc()  # finally frees the replica
            raise
        except ConnectionResetError:
            self._metrics.client_disconnects.inc()  # the client went away; finally frees the replica
            raise
        finally:
            if upstream is not None:
                # Not a clean end (error, timeout, client gone): close the socket so the
                # engine sees the disconnect and frees the request's KV cache.
                if ok:
                    upstream.release()
                else:
                    upstream.close()
            hooks.on_done(request, endpoint, Outcome(ok, verdict))
            if self._after_request is not None:
                self._after_request(endpoint)

    async def _open(
        self, request: InferenceRequest, endpoint: Endpoint, attempt: Attempt, body: bytes
    ) -> UpstreamResponse:
        form = request.form
        content_type = "application/json" if form is None else form.content_type
        headers = {"content-type": content_type, "x-request-id": request.request_id}
        if endpoint.auth_header is not None:
            headers["authorization"] = endpoint.auth_header
        if endpoint.dp_rank is not None:  # a data-parallel rank target (fleet/dp.py)
            headers[RANK_HEADER] = str(endpoint.dp_rank)
        wait = None
        first_byte_s = attempt.settings.timeouts.first_byte_s
        try:
            async with asyncio.timeout_at(wait_limit(attempt.deadline, first_byte_s)) as limit:
                with self._breakers.first_byte_wait(endpoint, limit, queued=True) as wait:
                    return await self._client.post(
                        endpoint.url,
                        request.upstream_path,
                        body,
                        headers,
                        on_slot=sending(request, wait.restart),
                    )
        except TimeoutError:
            if wait is not None and wait.aborted is not None:
                raise Retryable(wait.aborted) from None  # ejected while we waited: re-send elsewhere
            self._metrics.upstream_errors.labels(endpoint.name, "timeout").inc()
            raise UpstreamTimeout(f"endpoint {endpoint.name} did not answer in time") from None
        except ConnectFailed as exc:
            request.context.sent = False  # it never reached the replica
            self._metrics.upstream_errors.labels(endpoint.name, "connect").inc()
            raise Retryable("connect") from exc
        except ConnectionLost as exc:  # accepted, then closed before any response byte
            self._metrics.upstream_errors.labels(endpoint.name, "disconnected").inc()
            raise lost_before_answer(request, endpoint) from exc

    async def _server_error(
        self, endpoint: Endpoint, upstream: UpstreamResponse, headers: dict[str, str], attempt: Attempt
    ) -> Retryable:
        """A 5xx before the first byte: retryable; its body is kept to pass on if no retry
        succeeds, read briefly and capped (a trickled one held the retry for first_byte_s)."""
        reason = f"http_{upstream.status}"
        self._metrics.upstream_errors.labels(endpoint.name, reason).inc()
        body = b""
        try:
            async with asyncio.timeout_at(wait_limit(attempt.deadline, _ERROR_BODY_WAIT_S)):
                while len(body) <= _ERROR_BODY_MAX and (chunk := await upstream.readany()):
                    body += chunk
        except (TimeoutError, ConnectionLost):
            return Retryable(reason)  # its body stalled or broke: nothing worth passing on
        if len(body) > _ERROR_BODY_MAX:
            return Retryable(reason)
        headers["content-type"] = upstream.content_type
        return Retryable(reason, web.Response(status=upstream.status, body=body, headers=headers))

    async def _buffered(
        self,
        request: InferenceRequest,
        endpoint: Endpoint,
        upstream: UpstreamResponse,
        headers: dict[str, str],
        attempt: Attempt,
    ) -> web.Response:
        try:
            async with asyncio.timeout_at(
                wait_limit(attempt.deadline, attempt.settings.timeouts.first_byte_s)
            ):
                body = await upstream.read(attempt.settings.limits.max_response_bytes)
        except TimeoutError:
            raise UpstreamTimeout("upstream response body timed out") from None
        except ResponseTooLarge as exc:
            self._metrics.upstream_errors.labels(endpoint.name, "too_large").inc()
            raise UpstreamError(str(exc)) from None
        except ConnectionLost as exc:
            raise UpstreamError(f"upstream failed while sending its response: {exc}") from None
        if upstream.status == 200 and b'"abort"' in body and aborted(body):
            # vLLM shutting down answers in-flight requests 200 with finish_reason "abort" and
            # a truncated text. Nothing reached the client yet: re-send it elsewhere.
            self._metrics.upstream_errors.labels(endpoint.name, "aborted").inc()
            raise Retryable("aborted")
        if (
            upstream.status == 400
            and endpoint.dp_rank is not None
            and rank_out_of_range(body, endpoint.dp_rank)
        ):
            self._metrics.upstream_errors.labels(endpoint.name, RANK_REFUSED).inc()
            headers["content-type"] = upstream.content_type
            raise Retryable(RANK_REFUSED, web.Response(status=400, body=body, headers=headers))
        if upstream.status == 200:
            request.context.answer_head = body[:4096]
        attempt.hooks.on_first_byte(request, endpoint)
        request.context.ttft_ms = round((time.monotonic() - attempt.started) * 1000, 2)
        if upstream.status == 200:
            report_usage(request, endpoint, attempt.hooks, body, whole=True)
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
        attempt: Attempt,
    ) -> tuple[web.StreamResponse, bool]:
        """Pipe the SSE stream; returns the response and whether it ended cleanly.

        The client's response is committed only when the first chunk is in hand: until
        then a broken upstream (or, for SGLang P/D, a failed prefill leg) is retryable.
        """
        first_chunk = await self._first_chunk(request, endpoint, upstream, attempt)
        request.context.answer_head = first_chunk[:4096]
        headers["content-type"] = upstream.headers.get("content-type", "text/event-stream")
        headers["cache-control"] = "no-cache"
        response = web.StreamResponse(status=200, headers=headers)
        if http_request.version < HttpVersion11:  # no chunking: only the close can end the body
            response.force_close()
        await response.prepare(http_request)
        http_request[STREAM_STARTED] = True
        idle_s = attempt.settings.timeouts.idle_s
        # only whole events reach the client: a cut never leaves half of one
        events = event_buffer(request.api)
        head = events.complete(first_chunk)  # may be b"" (half an event): headers go out alone
        on_first = partial(self._first_byte, request, endpoint, attempt)
        if upstream.ended_cleanly:  # all of it is here (a short answer): headers, events, end: one write
            last = final = head + events.complete(upstream.take_buffered())
            request.context.streamed_chunks += last.count(b"data:")
            if last:
                on_first()
            failure, usage_tail = None, last[-4096:]
        else:
            try:
                async with asyncio.timeout_at(wait_limit(attempt.deadline, idle_s)):
                    await response.write(head)  # a client that left raises here, on purpose
            except TimeoutError:
                raise self._client_stopped_reading(http_request) from None
            transport = http_request.transport
            if transport is None:
                raise ConnectionResetError("the client went away mid-stream")
            if head:
                request.context.streamed_chunks += head.count(b"data:")
                on_first()
            first = None if head else on_first  # else the relay's first whole event is the first byte
            relay = StreamRelay(
                upstream, transport, http_request.writer, request.context, events, head, first
            )
            failure = await relay.run(attempt.deadline, idle_s)
            last = relay.closing() if failure is None else b""  # the events that came with the end
            final, usage_tail = relay.last, relay.previous[-2048:] + relay.last[-2048:]
        sse = "event-stream" in headers["content-type"]  # the body ended cleanly: is the stream whole?
        rest, failure = stream_end(events, sse, request.api) if failure is None else (b"", failure)
        last += rest
        if failure is None:
            report_usage(request, endpoint, attempt.hooks, usage_tail, whole=False)
        else:
            log.warning("request %s: %s", request.request_id, failure)
            self._metrics.upstream_errors.labels(endpoint.name, "mid_stream").inc()
            last += error_event(failure, mid_event=bool(final) and not ends_event(final), api=request.api)
        try:  # the stream's last bytes and its end, in one write; it waits on the client: bounded too
            async with asyncio.timeout(idle_s):
                await response.write_eof(last)
        except TimeoutError:
            raise self._client_stopped_reading(http_request) from None
        self._metrics.child(self._metrics.e2e, request.model).observe(time.monotonic() - attempt.started)
        return response, failure is None

    def _first_byte(self, request: InferenceRequest, endpoint: Endpoint, attempt: Attempt) -> None:
        """The stream's first whole event reached the client."""
        ttft = time.monotonic() - attempt.started
        self._metrics.child(self._metrics.ttft, request.model).observe(ttft)
        request.context.ttft_ms = round(ttft * 1000, 2)
        attempt.hooks.on_first_byte(request, endpoint)

    @staticmethod
    def _client_stopped_reading(http_request: web.Request) -> ConnectionResetError:
        """Not the upstream's stall: the client read nothing, so it is gone (and cut off)."""
        if http_request.transport is not None:
            http_request.transport.abort()
        return ConnectionResetError("the client did not read the stream in time")

    async def _first_chunk(
        self, request: InferenceRequest, endpoint: Endpoint, upstream: UpstreamResponse, attempt: Attempt
    ) -> bytes:
        wait = None
        try:
            limit_at = wait_limit(attempt.deadline, attempt.settings.timeouts.first_byte_s)
            async with asyncio.timeout_at(limit_at) as limit:
                with self._breakers.first_byte_wait(endpoint, limit) as wait:
                    return await unless_prefill_fails(request, read_past_role_chunk(request, upstream))
        except TimeoutError:
            if wait is not None and wait.aborted is not None:
                raise Retryable(wait.aborted) from None
            raise UpstreamTimeout("upstream sent headers but no data in time") from None
        except ConnectionLost as exc:
            raise lost_before_answer(request, endpoint) from exc
