"""The gateway's view of what each replica holds in its prefix cache.

Ties the request (its block hashes, computed once), the index backend (memory or
Redis), and the replicas' real capacities together, and closes the loop with what
the replica reports back: ``usage.prompt_tokens_details.cached_tokens``. When a
replica had less cached than we predicted, its cache is smaller (or busier) than the
index assumes, so the index's capacity for it shrinks (×0.9, floor 25 %); correct
predictions grow it back slowly (+1 %). None of our peers use that signal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.fleet.endpoint import Endpoint
from gateway.ops.metrics import GatewayMetrics
from gateway.prefix.chain_cache import HashChainCache
from gateway.prefix.index import PrefixIndex
from gateway.request.types import CHARS_PER_TOKEN, InferenceRequest

if TYPE_CHECKING:
    from gateway.prefix.exact_match import ExactPrefix

__all__ = ["PrefixCache", "PrefixMatch", "PrefixState"]

_TRUST_FLOOR = 0.25
_HASH_OFF_LOOP_CHARS = 262_144  # ~0.5 ms of hashing: above it the thread hop is cheaper than the stall


@dataclass(slots=True)
class PrefixMatch:
    prompt_blocks: int
    matched: dict[Endpoint, int]

    def ratio(self, endpoint: Endpoint) -> float:
        return self.matched.get(endpoint, 0) / self.prompt_blocks if self.prompt_blocks else 0.0

    def best(self) -> int:
        return max(self.matched.values(), default=0)


@dataclass(slots=True)
class PrefixState:
    """A request's prefix bookkeeping, in its context: hashed once, matched once per candidate set."""

    hashes: list[int]
    match: PrefixMatch | None = None
    # Estimated uncached prompt tokens sent to each endpoint and not yet answered.
    pending: dict[Endpoint, float] = field(default_factory=dict)
    # Exact index (engine KV events): the engine's prompt tokens ([]: unavailable) and the
    # cached tokens each endpoint with live exact state will report.
    engine_tokens: list[int] | None = None
    engine_token_count: int = 0  # the prompt's engine tokens (more than engine_tokens: a prefix)
    exact: dict[Endpoint, int] | None = None
    # Pending blocks (prefix.kv_events.pending_blocks): cached tokens for routing where blocks
    # sent and not reported yet add to ``exact``; per candidate (blocks held, the prompt's
    # block keys) until sent; per endpoint sent to, the keys it made pending there.
    exact_routing: dict[Endpoint, int] | None = None
    exact_keys: dict[Endpoint, tuple[int, list[int]]] | None = None
    exact_sent: dict[Endpoint, list[int]] | None = None


class PrefixCache:
    def __init__(
        self,
        index: PrefixIndex,
        metrics: GatewayMetrics,
        *,
        block_bytes: int,
        default_capacity_blocks: int,
        max_blocks: int | None = None,
    ) -> None:
        self.index = index
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks
        self._metrics = metrics
        self._default_capacity = default_capacity_blocks
        self._engine_capacity: dict[str, int] = {}
        self._trust: dict[str, float] = {}
        self.exact: ExactPrefix | None = None  # set by the wiring with prefix.exact: auto
        self.chains = HashChainCache()  # a conversation's next turn hashes only its new blocks

    # -- per request ----------------------------------------------------------------
    def state(self, request: InferenceRequest) -> PrefixState:
        """The request's prefix state, hashing its prompt on first use."""
        state = request.context.prefix
        if state is None:
            state = request.context.prefix = PrefixState(self._block_hashes(request))
        return state

    async def prepared_state(self, request: InferenceRequest) -> PrefixState:
        """:meth:`state`, with a long prompt hashed in a worker thread instead of on the event loop."""
        if request.context.prefix is None and len(request.prompt_text) > _HASH_OFF_LOOP_CHARS:
            hashes = await asyncio.to_thread(self._block_hashes, request)
            if request.context.prefix is None:
                request.context.prefix = PrefixState(hashes)
        return self.state(request)

    def _block_hashes(self, request: InferenceRequest) -> list[int]:
        return self.chains.block_hashes(
            request.model, request.prompt_text, self.block_bytes, self.max_blocks, request.session_id
        )

    def hashes(self, request: InferenceRequest) -> list[int]:
        return self.state(request).hashes

    async def match(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> PrefixMatch:
        """Match once per request; later callers (other scorers, other profiles) reuse it."""
        state = await self.prepared_state(request)
        cached = state.match
        if cached is not None and all(e in cached.matched for e in candidates):
            return cached
        hashes = state.hashes
        by_name = await self.index.match(hashes, [e.name for e in candidates], request.model)
        match = PrefixMatch(len(hashes), {e: by_name.get(e.name, 0) for e in candidates})
        state.match = match
        if hashes:
            self._metrics.prefix_predicted_blocks.inc(match.best())
            self._metrics.prefix_prompt_blocks.inc(len(hashes))
        if self.exact is not None:
            await self.exact.prepare(request, state, candidates)
        return match

    def current_match(self, request: InferenceRequest) -> PrefixMatch | None:
        state = request.context.prefix
        return state.match if state is not None else None

    def uncached_tokens(self, request: InferenceRequest, endpoint: Endpoint) -> float:
        """Estimated prompt tokens ``endpoint`` would have to prefill for ``request`` (exact:
        the blocks its engine reported, and those pending there with pending blocks on)."""
        state = request.context.prefix
        if state is not None and state.exact is not None and endpoint in state.exact:
            total = state.engine_token_count or len(state.engine_tokens or ())
            return float(max(0, total - self._routing_cached(state, endpoint)))
        match = self.current_match(request)
        matched = match.matched.get(endpoint, 0) if match else 0
        cached_tokens = matched * self.block_bytes / CHARS_PER_TOKEN
        return max(0.0, request.est_prompt_tokens - cached_tokens)

    @staticmethod
    def _routing_cached(state: PrefixState, endpoint: Endpoint) -> int:
        routing = state.exact_routing
        if routing is not None and endpoint in routing:
            return routing[endpoint]
        return state.exact[endpoint]  # type: ignore[index]

    def routing_cached_tokens(self, request: InferenceRequest, endpoint: Endpoint) -> int:
        """Cached prompt tokens for routing: :meth:`predicted_cached_tokens` plus pending blocks."""
        state = request.context.prefix
        if state is not None and state.exact is not None and endpoint in state.exact:
            return self._routing_cached(state, endpoint)
        return self.predicted_cached_tokens(request, endpoint)[0]

    def predicted_cached_tokens(self, request: InferenceRequest, endpoint: Endpoint) -> tuple[int, str]:
        """Prompt tokens ``endpoint`` should report cached, and which index says so (never
        pending blocks: the prediction and its error stay what the engines reported)."""
        state = request.context.prefix
        if state is not None and state.exact is not None and endpoint in state.exact:
            return state.exact[endpoint], "exact"
        match = state.match if state is not None else None
        matched = match.matched.get(endpoint, 0) if match else 0
        return min(request.est_prompt_tokens, matched * self.block_bytes // CHARS_PER_TOKEN), "approximate"

    def record(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        hashes = self.hashes(request)
        if hashes:
            self.index.record(hashes, endpoint.name, request.model)
        state = request.context.prefix
        if self.exact is not None and state is not None and state.exact_keys:
            self.exact.sent(state, endpoint)

    def released(self, request: InferenceRequest, endpoint: Endpoint) -> None:
        """The request's first byte or end on ``endpoint`` (its pending blocks' grace starts)."""
        state = request.context.prefix
        if self.exact is not None and state is not None and state.exact_sent:
            self.exact.released(state, endpoint)

    def observe_usage(
        self, request: InferenceRequest, endpoint: Endpoint, prompt_tokens: int, cached_tokens: int
    ) -> None:
        self._metrics.observed_prompt_tokens.inc(prompt_tokens)
        self._metrics.observed_cached_tokens.inc(cached_tokens)
        match = self.current_match(request)
        if self.exact is not None and match is not None:
            predicted, kind = self.predicted_cached_tokens(request, endpoint)
            self.exact.observe(kind, predicted - cached_tokens)
        if match is None or prompt_tokens <= 0:
            return
        predicted_fraction = match.ratio(endpoint)
        observed_fraction = cached_tokens / prompt_tokens
        trust = self._trust.get(endpoint.name, 1.0)
        if predicted_fraction > 0.2 and observed_fraction < predicted_fraction * 0.5:
            self._metrics.prefix_mispredictions.labels(endpoint.name).inc()
            trust = max(_TRUST_FLOOR, trust * 0.9)
        elif predicted_fraction > 0:
            trust = min(1.0, trust + 0.01)
        else:
            return
        if trust != self._trust.get(endpoint.name, 1.0):
            self._trust[endpoint.name] = trust
            self._apply_capacity(endpoint.name)

    # -- fleet changes --------------------------------------------------------------
    def update_engine_capacity(self, endpoint: Endpoint) -> None:
        """Derive the index bound from the engine's real KV size (``vllm:cache_config_info``)."""
        m = endpoint.metrics
        if m.block_size and m.num_blocks:
            tokens = m.block_size * m.num_blocks
            blocks = max(1, int(tokens * CHARS_PER_TOKEN / self.block_bytes))
            if self.exact is not None:
                self.exact.update_capacity(endpoint)
            if self._engine_capacity.get(endpoint.name) != blocks:
                self._engine_capacity[endpoint.name] = blocks
                self._apply_capacity(endpoint.name)

    def _apply_capacity(self, name: str) -> None:
        base = self._engine_capacity.get(name, self._default_capacity)
        self.index.set_capacity(name, max(1, int(base * self._trust.get(name, 1.0))))

    def size(self, endpoint: Endpoint) -> int:
        return self.index.size(endpoint.name)

    def capacity(self, endpoint: Endpoint) -> int:
        """Blocks the index keeps for this endpoint: its engine's KV size, shrunk by mispredictions."""
        return self.index.capacity(endpoint.name)

    def occupancy(self, endpoint: Endpoint) -> float:
        """Fraction of the endpoint's (believed) cache the index has filled."""
        name = endpoint.name
        return min(1.0, self.index.size(name) / max(1, self.index.capacity(name)))

    async def forget(self, endpoint: Endpoint) -> None:
        """Endpoint removed, restarted or down: nothing we recorded for it is true any more."""
        name = endpoint.name
        await self.index.purge(name, tuple(endpoint.models))
        if name in self._engine_capacity or name in self._trust:
            # The purge dropped its bound too; the engine reports the same KV size after a restart,
            # which the scrape re-applies only when it changes: without this, the default for good.
            self._apply_capacity(name)
        if self.exact is not None:
            self.exact.forget(endpoint)

    def drop(self, name: str) -> None:
        """The endpoint left the fleet: its KV size, trust and exact-index state go too."""
        self._engine_capacity.pop(name, None)
        self._trust.pop(name, None)
        if self.exact is not None:
            self.exact.drop(name)
