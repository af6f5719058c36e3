"""Where an endpoint's KV-event stream is: its config, or ``GET /kv_event_sources`` on the replica.

vLLM binds its publisher (``tcp://*:PORT``) and the gateway connects to the replica's host;
a data-parallel server answers one config per rank, or one whose ports each rank offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from gateway.config.kv_events import KVEventSourceConfig
from gateway.fleet.endpoint import Endpoint

__all__ = ["KVEventSource", "discover_source", "source_from"]


@dataclass(frozen=True, slots=True)
class KVEventSource:
    endpoint: str
    replay_endpoint: str | None
    topic: str = ""


def _on_host(address: str | None, host: str) -> str | None:
    """``tcp://*:5557`` (or ``0.0.0.0``/``::``) → ``tcp://<host>:5557``: vLLM binds, we connect."""
    if not address:
        return None
    scheme, _, rest = address.partition("://")
    bound, _, port = rest.rpartition(":")
    if bound in ("*", "0.0.0.0", "[::]", "::", ""):
        bound = f"[{host}]" if ":" in host else host
    return f"{scheme}://{bound}:{port}"


def source_from(raw: Any, host: str, rank: int | None = None) -> KVEventSource | None:
    """A vLLM KVEventsConfig, or several keyed by DP rank (vLLM 0.32) or listed: the first rank's,
    or rank ``rank``'s (a data-parallel rank target; a single config: its ports offset by the rank)."""
    if isinstance(raw, dict) and isinstance(raw.get("sources", raw.get("data")), list):
        raw = raw.get("sources", raw.get("data"))
    offset = 0
    if isinstance(raw, dict) and raw and all(isinstance(k, str) and k.isascii() and k.isdigit() for k in raw):
        # vLLM 0.32: {"<dp rank>": KVEventsConfig, ...}
        raw = raw[min(raw, key=int)] if rank is None else raw.get(str(rank))
    elif isinstance(raw, list):
        index = 0 if rank is None else rank
        raw = raw[index] if 0 <= index < len(raw) else None
    elif rank is not None:
        offset = rank  # one config for every rank: vLLM's offset_endpoint_port
    if isinstance(raw, KVEventSourceConfig):
        if not raw.enabled:
            return None
        raw = raw.model_dump()
    if not isinstance(raw, dict) or raw.get("enable_kv_cache_events") is False:
        return None
    if raw.get("publisher", "zmq") != "zmq":
        return None
    endpoint = raw.get("endpoint")
    if not isinstance(endpoint, str) or not _tcp_address(endpoint):
        return None  # only tcp://host:port (a port in 1..65535): anything else is garbage
    replay = raw.get("replay_endpoint")
    if not isinstance(replay, str) or not _tcp_address(replay):
        replay = None
    topic = raw.get("topic") or ""
    return KVEventSource(
        _offset(_on_host(endpoint, host) or endpoint, offset) or endpoint,
        _offset(_on_host(replay, host), offset) if isinstance(replay, str) else None,
        topic if isinstance(topic, str) else "",
    )


def _tcp_address(address: str) -> bool:
    port = address.rpartition(":")[2]
    return address.startswith("tcp://") and port.isascii() and port.isdigit() and 0 < int(port) < 65536


def _offset(address: str | None, by: int) -> str | None:
    head, _, port = (address or "").rpartition(":")
    return f"{head}:{int(port) + by}" if by and port.isascii() and port.isdigit() else address


async def discover_source(
    session: aiohttp.ClientSession, endpoint: Endpoint, timeout_s: float
) -> KVEventSource | None:
    host = urlsplit(endpoint.base_url).hostname or "127.0.0.1"
    try:
        async with session.get(
            endpoint.base_url + "/kv_event_sources",
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            headers={"authorization": endpoint.auth_header} if endpoint.auth_header else None,
            ssl=endpoint.ssl_context or True,
        ) as resp:
            if resp.status != 200:
                return None
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError):
        return None
    return source_from(body, host, endpoint.dp_rank)  # a DP rank target: its rank's entry
