"""Profile handler ``pd-disagg``: prefill/decode disaggregation as two scheduling profiles.

Runs the ``decode`` profile first (every request needs a decode replica), then asks the
decider whether this request should be prefilled elsewhere; if so it runs the
``prefill`` profile too. The proxy sends with the decode ranking and, when a prefill
ranking exists, runs the prefill leg first (vLLM NixlConnector) or alongside
(SGLang bootstrap).

Deciders:
- ``always``: every request is disaggregated;
- ``never``: decode-only (the pools still exist; useful to compare);
- ``prefix-aware``: disaggregate only when the part of the prompt the chosen decode
  replica has *not* cached exceeds ``threshold_tokens`` — short or mostly cached
  prompts are cheaper to prefill in place than to transfer (llm-d's prefix-based decider).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.prefix.cache import PrefixCache
from gateway.request.types import ApiKind, InferenceRequest
from gateway.scheduling.framework import PluginContext
from gateway.scheduling.result import PDDecision, ScoredEndpoint
from policies.params import Params

TYPE_NAME = "pd-disagg"
# The APIs whose prefill leg is capped at one token by ``max_tokens`` and handed over in the body
# (vLLM 0.32 takes kv_transfer_params on all three). Not the Responses API: its prefill leg
# would store a response on the prefill replica, and a chain continues only where its previous
# response is stored. Nor embeddings, tokenize, rerank: they have no decode to hand over to.
_GENERATING = frozenset({ApiKind.CHAT, ApiKind.COMPLETIONS, ApiKind.MESSAGES})


class PDProfileHandler:
    def __init__(
        self,
        name: str,
        prefix: PrefixCache,
        decider: str,
        threshold_tokens: float,
        decode_profile: str,
        prefill_profile: str,
        fallback_to_decode: bool = True,
    ) -> None:
        self.name = name
        self._prefix = prefix
        self._decider = decider
        self._threshold = threshold_tokens
        self._decode = decode_profile
        self._prefill = prefill_profile
        self._fallback = fallback_to_decode
        self.one_token_leg = True  # vLLM's: the leg is capped at one token (refused under thinking)

    def profiles_used(self) -> tuple[str, ...]:
        return (self._decode, self._prefill)

    def pick_profiles(
        self,
        request: InferenceRequest,
        profiles: Sequence[str],
        results: dict[str, list[ScoredEndpoint]],
    ) -> list[str]:
        if not results:
            return [self._decode]
        if self._prefill in results:
            return []
        disaggregate, reason = self._decide(request, results[self._decode])
        request.context.pd_decision = PDDecision(disaggregate, reason)
        return [self._prefill] if disaggregate else []

    def _decide(self, request: InferenceRequest, decode_ranked: list[ScoredEndpoint]) -> tuple[bool, str]:
        if request.api not in _GENERATING:
            return False, "api_not_disaggregated"
        if self.one_token_leg and request.api is ApiKind.MESSAGES and _thinks(request.body):
            return False, "thinking_budget"
        if self._decider == "always":
            return True, "always"
        if self._decider == "never":
            return False, "never"
        uncached = self._prefix.uncached_tokens(request, decode_ranked[0].endpoint)
        if uncached > self._threshold:
            return True, "uncached_prompt_long"
        return False, "uncached_prompt_short"

    def primary_profile(self, request: InferenceRequest, results: dict[str, list[ScoredEndpoint]]) -> str:
        return self._decode

    def prefill_profile(
        self, request: InferenceRequest, results: dict[str, list[ScoredEndpoint]]
    ) -> str | None:
        return self._prefill if results.get(self._prefill) else None

    def without_candidates(self, request: InferenceRequest, profile: str) -> bool:
        """No prefill replica can serve (all down, ejected or draining): decode-only, as a failed
        prefill leg is with ``fallback_to_decode``; without it the request fails (503)."""
        if profile != self._prefill or not self._fallback:
            return False
        request.context.pd_decision = PDDecision(False, "no_prefill_replica")
        return True


def _thinks(body: Mapping[str, Any]) -> bool:
    """Extended thinking asks for ``budget_tokens`` (at least 1,024) below ``max_tokens``: a prefill
    leg capped at one token is refused by vLLM (400), so such a request is not disaggregated."""
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") == "enabled"


def create(name: str, parameters: Mapping[str, Any], context: PluginContext) -> PDProfileHandler:
    params = Params(parameters)
    decider = params.choice("decider", "prefix-aware", ("always", "never", "prefix-aware"))
    threshold = params.number("threshold_tokens", 512, low=0)
    decode = params.optional_string("decode_profile") or "decode"
    prefill = params.optional_string("prefill_profile") or "prefill"
    fallback = params.boolean("fallback_to_decode", True)
    protocol = params.choice("protocol", "vllm", ("vllm", "sglang"))
    params.done()
    handler = PDProfileHandler(name, context.prefix, decider, threshold, decode, prefill, fallback)
    handler.one_token_leg = protocol == "vllm"  # SGLang's prefill leg is the client's whole request
    return handler
