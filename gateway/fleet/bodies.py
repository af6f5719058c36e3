"""Bounded reads of what the replicas answer the gateway's own probes (``/metrics``, ``/v1/models``).

A real vLLM ``/metrics`` page is ~60 KB and a model list a few KB. An unbounded read of a
broken or hostile replica's page (100 MiB: aiohttp's buffer, the decode and the parse on the
event loop) stalled every request for over a second, once per scrape interval.
"""

from __future__ import annotations

import aiohttp

__all__ = ["MAX_PROBE_BODY_BYTES", "read_bounded"]

MAX_PROBE_BODY_BYTES = 16 * 1024 * 1024


async def read_bounded(resp: aiohttp.ClientResponse, limit: int = MAX_PROBE_BODY_BYTES) -> bytes:
    """The whole body; :class:`ValueError` (a failed probe) once it is larger than ``limit``."""
    if resp.content_length is not None and resp.content_length > limit:
        raise ValueError(f"answer of {resp.content_length} bytes, more than {limit}")
    body = bytearray()
    async for chunk in resp.content.iter_chunked(65536):
        body += chunk
        if len(body) > limit:
            raise ValueError(f"answer larger than {limit} bytes")
    return bytes(body)
