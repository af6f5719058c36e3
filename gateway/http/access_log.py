"""Structured access log: one JSON line per request (``server.access_log: json``).

Fields: time, request id, method, path, status, duration and time to first byte (ms),
model, priority, tenant, the endpoint that answered, and why it was chosen (scheduling
profile, winning score, P/D decision, session pin state). Written to the
``llm_gateway.access`` logger, so deployment decides where lines go.
"""

from __future__ import annotations

import json
import logging
import time

from aiohttp import web

from gateway.errors import bounded
from gateway.request.types import InferenceRequest

__all__ = ["INFERENCE_REQUEST", "AccessLog"]

INFERENCE_REQUEST: web.RequestKey[InferenceRequest] = web.RequestKey("inference_request", InferenceRequest)

log = logging.getLogger("llm_gateway.access")
_MAX_NAME_CHARS = 256  # a model or tenant name as the client sent it: a line per request must stay small


class AccessLog:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def write(self, http_request: web.Request, request_id: str, status: int, started: float) -> None:
        record: dict[str, object] = {
            "ts": round(time.time(), 3),
            "id": request_id,
            "method": http_request.method,
            "path": http_request.path,
            "status": status,
            "duration_ms": round((time.monotonic() - started) * 1000, 2),
        }
        request = http_request.get(INFERENCE_REQUEST)
        if request is not None:
            context = request.context
            model, tenant = bounded(request.model, _MAX_NAME_CHARS), bounded(request.tenant, _MAX_NAME_CHARS)
            record.update(model=model, priority=request.priority, tenant=tenant)
            if context.endpoint is not None:
                record["endpoint"] = context.endpoint
            if context.ttft_ms is not None:
                record["ttft_ms"] = context.ttft_ms
            if context.route is not None:
                record["route"] = {"profile": context.route.profile, "score": context.route.score}
            if context.pd_decision is not None:
                record["pd_decision"] = [context.pd_decision.disaggregate, context.pd_decision.reason]
            if context.session is not None and context.session.state is not None:
                record["session_pin_state"] = context.session.state
        log.info(json.dumps(record, separators=(",", ":"), default=str))
