"""Config of the exact prefix index: the engines' KV-event streams and the tokens for requests.

``prefix.exact: auto`` subscribes to every endpoint that publishes KV events (found with
``GET /kv_event_sources``, or named per endpoint with ``endpoints[].kv_events``) and routes
on the blocks the engines report; ``off`` keeps the approximate index alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from gateway.config.base import Strict as _Strict

__all__ = ["ExactPrefixConfig", "KVEventSourceConfig", "TokenizerConfig"]


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


def _tokenizer_dir(value: str) -> str:
    if not (Path(value) / "tokenizer.json").is_file():
        raise ValueError(f"{value!r} holds no tokenizer.json")
    return value


class TokenizerConfig(_Strict):
    """Where the engine's prompt tokens come from: computed here, or the engine's ``/tokenize``."""

    source: Literal["auto", "local", "engine"] = Field(
        "auto",
        description="auto: local where a tokenizer is found for the model (checked against the engine's "
        "/tokenize on its first requests), else /tokenize; local: local only, no /tokenize (a request the "
        "local path cannot do goes to the approximate index); engine: always /tokenize",
    )
    path: str | None = Field(
        None, description="a directory with tokenizer.json, for every model not in models"
    )
    models: dict[str, str] = Field(
        default_factory=dict, description="served model name -> directory with tokenizer.json"
    )
    hf_cache: bool = Field(True, description="look in the local Hugging Face cache (never downloads)")
    verify_requests: int = Field(
        3, ge=0, description="auto: a model's first N local answers are compared with /tokenize before use"
    )
    reverify_every: int = Field(1000, ge=0, description="auto: compare one request in N in the background")
    threads: int = Field(2, ge=1, le=64, description="tokenizer threads (off the event loop)")
    inline_chars: int = Field(
        16384,
        ge=0,
        le=1_000_000,
        description="new text up to this long (a quarter of it if not ASCII) is encoded on the event loop "
        "(~4k tokens, 1.5-3 ms): "
        "a thread's two GIL handoffs cost more than that on a busy gateway; longer in the threads",
    )
    max_prompt_chars: int = Field(4_000_000, ge=1, description="longer prompts are not tokenized locally")

    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str | None) -> str | None:
        return None if value is None else _tokenizer_dir(value)

    @field_validator("models")
    @classmethod
    def _check_models(cls, value: dict[str, str]) -> dict[str, str]:
        for name, directory in value.items():
            try:
                _tokenizer_dir(directory)
            except ValueError as exc:
                raise ValueError(f"models.{name}: {exc}") from None
        return value


class ExactPrefixConfig(_Strict):
    discover: bool = Field(True, description="ask each endpoint's GET /kv_event_sources")
    rediscover_s: float = Field(10.0, gt=0, description="retry an endpoint without a stream this often")
    replay_timeout_s: float = Field(
        1.0, gt=0, description="longest wait for a replay's next frame (not its whole: 10k batches take ~1 s)"
    )
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
    pending_blocks: bool = Field(
        True,  # measured: docs/benchmarks.md §11 "Pending blocks"
        description="route on blocks sent to a replica and not reported by its engine yet: a request's "
        "blocks count as cached there (for routing only, never in the predicted cached tokens) from "
        "its send until the engine's BlockStored, or its first byte plus pending_grace_s",
    )
    pending_grace_s: float = Field(
        0.5, ge=0, description="how long pending blocks outlive their request's first byte (event lag)"
    )
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    max_blocks_per_endpoint: int = Field(
        1_048_576, ge=1, description="bound when the engine does not report its KV size"
    )
