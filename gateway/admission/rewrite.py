"""The gateway's own changes to a request's body (degrade's output cap and fallback model, an
alias's target, a tenant's defaults), sent on as the re-serialised body."""

from __future__ import annotations

import json

from gateway.request.types import ApiKind, InferenceRequest

__all__ = ["clamp_max_tokens", "rewrite_body", "switch_model"]


def rewrite_body(request: InferenceRequest) -> None:
    """Re-serialise ``request.body`` after the gateway changed it (the proxy sends ``raw_body``)."""
    if request.form is not None:  # multipart (audio): the same parts, the changed fields
        request.raw_body = request.form.encode(request.body)
        return
    request.raw_body = json.dumps(request.body, separators=(",", ":")).encode()


# Where each API caps its output, preferred first; APIs without output tokens are not clamped.
_OUTPUT_CAPS = {
    ApiKind.CHAT: ("max_completion_tokens", "max_tokens"),
    ApiKind.COMPLETIONS: ("max_tokens",),
    ApiKind.MESSAGES: ("max_tokens",),
    ApiKind.RESPONSES: ("max_output_tokens",),
}


def clamp_max_tokens(request: InferenceRequest, ceiling: int) -> str | None:
    """Cap the output at ``ceiling`` in the API's own field; what changed, None when nothing did."""
    fields = _OUTPUT_CAPS.get(request.api)
    if fields is None:  # embeddings, rerank, audio …: nothing to shorten
        return None
    key = next((f for f in fields if f in request.body), fields[-1])
    value = request.body.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value <= ceiling:
        return None
    request.body[key] = ceiling
    rewrite_body(request)
    return f"{key}={ceiling}"


def switch_model(request: InferenceRequest, model: str) -> str:
    """Send the request to ``model`` instead; what changed, for the response header."""
    request.body["model"] = model
    request.model = model
    rewrite_body(request)
    return f"model={model}"
