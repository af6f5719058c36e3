"""Config of the exact prefix index: the engines' KV-event streams and the tokens for requests.

``prefix.exact: auto`` subscribes to every endpoint that publishes KV events (found with
``GET /kv_event_sources``, or named per endpoint with ``endpoints[].kv_events``) and routes
on the blocks the engines report; ``off`` keeps the approximate index alone.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from gateway.config.base import Strict as _Strict

__all__ = ["ExactPrefixConfig", "KVEventSourceConfig"]


def _zmq_tcp(value: str | None) -> str | None:
    if value is not None and not value.startswith("tcp://"):
        raise ValueError("must be a tcp://host:port ZMQ address")
    return value


class KVEventSourceConfig(_Strict):
    """One endpoint's stream, instead of what its ``/kv_event_sources`` says (``*`` = its host)."""

    endpoint: str = Field(description="the PUB address, e.g. tcp://10.0.0.5:5557")
    replay_endpoint: str | None = Field(None, description="the replay ROUTER address; none: no replay")
    topic: str = ""
    enabled: bool = Field(True, description="false: never subscribe to this endpoint")

    _check_endpoint = field_validator("endpoint", "replay_endpoint")(_zmq_tcp)


class ExactPrefixConfig(_Strict):
    discover: bool = Field(True, description="ask each endpoint's GET /kv_event_sources")
    rediscover_s: float = Field(10.0, gt=0, description="retry an endpoint without a stream this often")
    replay_timeout_s: float = Field(1.0, gt=0)
    stale_after_s: float = Field(
        2.0, gt=0, description="events published longer ago than this when applied: the endpoint is stale"
    )
    tokenize_timeout_s: float = Field(0.1, gt=0, description="the engine's /tokenize; slower: approximate")
    token_cache_entries: int = Field(4096, ge=0, description="prompts whose engine tokens are kept (LRU)")
    reuse_turn_tokens: bool = Field(
        False,
        description="match a conversation's next turn on the previous turn's engine tokens (once the "
        "model's template is seen to extend turns) and fetch its own in the background: no /tokenize "
        "wait on the critical path, but blocks of the engine's own answer are not predicted",
    )
    max_blocks_per_endpoint: int = Field(
        1_048_576, ge=1, description="bound when the engine does not report its KV size"
    )
