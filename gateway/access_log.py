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

from gateway.types import InferenceRequest

__all__ = ["INFERENCE_REQUEST", "AccessLog"]

INFERENCE_REQUEST: web.RequestKey[InferenceRequest] = web.RequestKey("inference_request", InferenceRequest)

log = logging.getLogger("llm_gateway.access")


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
            attributes = request.attributes
            record.update(model=request.model, priority=request.priority, tenant=request.tenant)
            for key in ("endpoint", "ttft_ms", "route", "pd_decision", "session_pin_state"):
                if key in attributes:
                    record[key] = attributes[key]
        log.info(json.dumps(record, separators=(",", ":"), default=str))
