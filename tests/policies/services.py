"""Real app services for plugin unit tests: a PrefixCache over a MemoryPrefixIndex and a
SessionAffinity over a MemorySessionStore, plus prompts of an exact number of prefix blocks."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.admission.saturation import SaturationDetector
from gateway.config import AdmissionConfig
from gateway.ops.metrics import GatewayMetrics
from gateway.prefix.cache import PrefixCache
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import PluginContext
from gateway.sessions.affinity import SessionAffinity
from gateway.sessions.store import MemorySessionStore, SessionTokens
from tests.policies.helpers import request

__all__ = ["BLOCK_BYTES", "TOKENS_PER_BLOCK", "Services", "blocks_prompt", "services"]

BLOCK_BYTES = 64
TOKENS_PER_BLOCK = 16  # 64 bytes / CHARS_PER_TOKEN
# A chat prompt is "user" + a role separator + the text + a message separator.
_CHAT_OVERHEAD = len(request(text="").prompt_text.encode())


@dataclass
class Services:
    context: PluginContext
    index: MemoryPrefixIndex
    store: MemorySessionStore
    tokens: SessionTokens

    @property
    def prefix(self) -> PrefixCache:
        return self.context.prefix

    @property
    def sessions(self) -> SessionAffinity:
        return self.context.sessions

    @property
    def metrics(self) -> GatewayMetrics:
        return self.context.metrics


def services(
    *,
    capacity_blocks: int = 1000,
    ttl_s: float = 3600.0,
    session_ttl_s: float = 600.0,
    token_header: str | None = "x-session-token",
    queue_depth_threshold: float = 5,
) -> Services:
    metrics = GatewayMetrics()
    index = MemoryPrefixIndex(default_capacity=capacity_blocks, ttl_s=ttl_s)
    prefix = PrefixCache(index, metrics, block_bytes=BLOCK_BYTES, default_capacity_blocks=capacity_blocks)
    detector = SaturationDetector(AdmissionConfig(queue_depth_threshold=queue_depth_threshold))
    store = MemorySessionStore(ttl_s=session_ttl_s, max_sessions=100)
    tokens = SessionTokens("test-secret")
    affinity = SessionAffinity(store, tokens, detector, metrics, token_header)
    context = PluginContext(metrics=metrics, prefix=prefix, sessions=affinity, saturation=detector)
    return Services(context, index, store, tokens)


def blocks_prompt(blocks: int, seed: str = "a", *, model: str = "m", **headers: str) -> InferenceRequest:
    """A chat request whose canonical prompt is exactly ``blocks`` prefix blocks long
    (``16 × blocks`` estimated tokens). Requests with the same ``seed`` share their prefix."""
    body_len = blocks * BLOCK_BYTES - _CHAT_OVERHEAD
    text = (seed * body_len)[:body_len]
    req = request(model, text, **headers)
    assert len(req.prompt_text.encode()) == blocks * BLOCK_BYTES
    assert req.est_prompt_tokens == blocks * TOKENS_PER_BLOCK
    return req
