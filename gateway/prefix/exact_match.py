"""Exact prefix matches for a request, per endpoint, where the endpoint's KV events are live.

:class:`PrefixCache` calls :meth:`ExactPrefix.prepare` from its ``match`` (so every
policy that matches prefixes — ``prefix-cost`` among them — gets exact numbers without
knowing about them): for the candidates whose exact state is live it fetches the
engine's tokens once per request (:class:`EngineTokens`), computes the block keys once per
block size, and stores the cached tokens the engine will report — the longest run of
held blocks, at most ``(prompt tokens − 1) // block size`` blocks, since the engine always
computes the last prompt token — in the request's :class:`PrefixState`. Candidates
without live exact state are answered by the approximate index: a per-endpoint fallback,
counted (``llm_gateway_prefix_exact_fallbacks``) for endpoints that have a stream.

With pending blocks on (``prefix.kv_events.pending_blocks``), :meth:`sent` marks the blocks a
request sent to an endpoint does not find there as pending on it, and :meth:`released` (its
first byte or its end) starts their grace; ``prepare`` also stores, in ``state.exact_routing``,
the blocks held *or pending* where that is more than those held: what the scorers see
(``PrefixCache.uncached_tokens``), while the prediction (``state.exact``) stays engine-exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gateway.fleet.endpoint import Endpoint
from gateway.ops.kv_metrics import KVEventMetrics
from gateway.prefix.engine_tokens import EngineTokens
from gateway.prefix.exact import ExactIndex, block_keys
from gateway.request.types import InferenceRequest

if TYPE_CHECKING:
    from gateway.prefix.cache import PrefixState

__all__ = ["ExactPrefix"]

_KEYS_OFF_LOOP_TOKENS = 32_768  # ~2 ms of hashing: above it a worker thread is cheaper than the stall


class ExactPrefix:
    def __init__(self, index: ExactIndex, tokens: EngineTokens, metrics: KVEventMetrics) -> None:
        self.index = index
        self.tokens = tokens
        self.metrics = metrics

    async def prepare(
        self, request: InferenceRequest, state: PrefixState, candidates: Sequence[Endpoint]
    ) -> None:
        index = self.index
        pending = index.pending_grace_s is not None
        exact = state.exact if state.exact is not None else {}
        todo = []
        for endpoint in candidates:
            if endpoint in exact:
                continue
            if index.live(endpoint.name) and self._block_size(endpoint):
                todo.append(endpoint)
            elif index.known(endpoint.name):
                self.metrics.fallback(endpoint.name, "not_live").inc()
        if not todo:
            return
        # the least busy engine answers fastest and slows no one's prefill much
        target = min(todo, key=lambda e: (e.in_flight, e.pending_prefill_tokens))
        if state.engine_tokens is None:
            state.engine_tokens, state.engine_token_count = await self.tokens.routing_tokens(request, target)
        tokens = state.engine_tokens
        count = state.engine_token_count or len(tokens)
        if not tokens:
            for endpoint in todo:
                self.metrics.fallback(endpoint.name, "no_tokens").inc()
            return
        keys: dict[tuple[int, str | None], list[int]] = {}
        for endpoint in todo:
            size = self._block_size(endpoint)
            # an adapter the replica serves (/v1/models) is one before its first BlockStored names it
            model = request.model
            adapter = model in endpoint.owner.adapters or index.lora_known(endpoint.name, model)
            lora = model if adapter else None
            chain = keys.get((size, lora))
            if chain is None:
                if len(tokens) > _KEYS_OFF_LOOP_TOKENS:
                    chain = await asyncio.to_thread(block_keys, tokens, size, lora)
                else:
                    chain = block_keys(tokens, size, lora)
                keys[(size, lora)] = chain
            held = index.matched_blocks(endpoint.name, chain)
            limit = (count - 1) // size
            exact[endpoint] = min(held, limit) * size
            if pending:
                routing = min(index.routing_blocks(endpoint.name, chain, held), limit) * size
                if routing > exact[endpoint]:
                    if state.exact_routing is None:
                        state.exact_routing = {}
                    state.exact_routing[endpoint] = routing
                if state.exact_keys is None:
                    state.exact_keys = {}
                state.exact_keys[endpoint] = (held, chain)
        state.exact = exact

    def sent(self, state: PrefixState, endpoint: Endpoint) -> None:
        """The request went to ``endpoint``: its blocks not held there are pending there."""
        keys = state.exact_keys.pop(endpoint, None) if state.exact_keys else None
        if keys is None:
            return
        held, chain = keys
        if held < len(chain):
            self.index.add_pending(endpoint.name, chain[held:])
            if state.exact_sent is None:
                state.exact_sent = {}
            state.exact_sent[endpoint] = chain[held:]

    def released(self, state: PrefixState, endpoint: Endpoint) -> None:
        """Its first byte (or its end): the pending blocks it added count ``pending_grace_s`` more."""
        keys = state.exact_sent.pop(endpoint, None) if state.exact_sent else None
        if keys is not None:
            self.index.release_pending(endpoint.name, keys)

    def _block_size(self, endpoint: Endpoint) -> int:
        """From its events, else from its metrics (vllm:cache_config_info); 0: unknown yet."""
        return self.index.block_size(endpoint.name) or endpoint.metrics.block_size or 0

    def observe(self, kind: str, error_tokens: int) -> None:
        self.metrics.error(kind).observe(error_tokens)

    def update_capacity(self, endpoint: Endpoint) -> None:
        if endpoint.metrics.num_blocks:
            self.index.set_capacity(endpoint.name, endpoint.metrics.num_blocks)

    def drop(self, name: str) -> None:
        """Left the fleet: its entry and series (the event follower drops them too, but only
        for a replica it had started following: one that left within a second kept them)."""
        self.index.clear(name, "removed")
        self.metrics.forget(name)

    def forget(self, endpoint: Endpoint) -> None:
        """Removed, restarted or down. A live stream stays in sequence (a restart breaks its
        connection, and every reconnection starts the state over), so only a dead one's goes."""
        if not self.index.live(endpoint.name):
            self.index.clear(endpoint.name, "forget")
        self.index.drop_pending(endpoint.name)  # nothing in flight there will be stored
