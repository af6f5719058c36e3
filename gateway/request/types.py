"""The request as every stage after parsing sees it, and the typed context the stages fill in.

The body is parsed once (:mod:`gateway.request.parse`); later stages read
:class:`InferenceRequest`, never the body again. What a stage learns about the request
on its way (prefix match, session pin, P/D leg, the endpoint that answered, usage)
goes into :class:`RequestContext`, one typed slot per writer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # slot types owned by the stages that write them
    from gateway.admission.latency_model import LatencySample
    from gateway.prefix.cache import PrefixState
    from gateway.proxy.pd import PDState
    from gateway.request.multipart import Form
    from gateway.scheduling.result import PDDecision
    from gateway.sessions.affinity import SessionPin

__all__ = [
    "CHARS_PER_TOKEN",
    "FORM_APIS",
    "ApiKind",
    "InferenceRequest",
    "Priority",
    "RequestContext",
    "RouteTrace",
    "Slo",
    "Usage",
]

# Prompt characters per token, for estimates before exact token counts exist. One value
# for load accounting and for the prefix index's block-to-token conversion.
CHARS_PER_TOKEN = 4


class Priority(StrEnum):
    """Traffic class: ``critical`` goes first, ``standard`` queues, ``sheddable`` is shed first."""

    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"

    @property
    def rank(self) -> int:
        """0 for the most important class; a larger rank yields to a smaller one."""
        return _PRIORITY_RANK[self]


_PRIORITY_RANK = {Priority.CRITICAL: 0, Priority.STANDARD: 1, Priority.SHEDDABLE: 2}


class ApiKind(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"  # OpenAI Responses API (stateful on the replica)
    MESSAGES = "messages"  # Anthropic Messages API
    COUNT_TOKENS = "count_tokens"  # Anthropic /v1/messages/count_tokens
    RERANK = "rerank"  # /v1/rerank, /rerank, /v2/rerank (the path is passed through)
    SCORE = "score"  # /v1/score, /score
    CLASSIFY = "classify"
    POOLING = "pooling"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    TRANSCRIPTIONS = "transcriptions"  # multipart/form-data: the audio file, model as a form field
    TRANSLATIONS = "translations"

    @property
    def upstream_path(self) -> str:
        return _UPSTREAM_PATHS[self]

    @property
    def streams(self) -> bool:
        """Whether ``stream: true`` means an SSE answer for this API."""
        return self in _STREAMING


_UPSTREAM_PATHS = {
    ApiKind.CHAT: "/v1/chat/completions",
    ApiKind.COMPLETIONS: "/v1/completions",
    ApiKind.EMBEDDINGS: "/v1/embeddings",
    ApiKind.RESPONSES: "/v1/responses",
    ApiKind.MESSAGES: "/v1/messages",
    ApiKind.COUNT_TOKENS: "/v1/messages/count_tokens",
    ApiKind.RERANK: "/v1/rerank",
    ApiKind.SCORE: "/v1/score",
    ApiKind.CLASSIFY: "/classify",
    ApiKind.POOLING: "/pooling",
    ApiKind.TOKENIZE: "/tokenize",
    ApiKind.DETOKENIZE: "/detokenize",
    ApiKind.TRANSCRIPTIONS: "/v1/audio/transcriptions",
    ApiKind.TRANSLATIONS: "/v1/audio/translations",
}
_STREAMING = frozenset(
    {ApiKind.CHAT, ApiKind.COMPLETIONS, ApiKind.RESPONSES, ApiKind.MESSAGES, ApiKind.TRANSCRIPTIONS}
)
FORM_APIS = frozenset({ApiKind.TRANSCRIPTIONS, ApiKind.TRANSLATIONS})  # multipart/form-data bodies


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts an engine reported for one answer (its ``usage`` object)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Slo:
    """The request's latency objectives (``x-slo-*`` headers, else the priority's defaults).

    ``deadline`` is the monotonic instant its first token is due: arrival + ``ttft_ms``
    (None without a TTFT objective). Queueing spends from it; routing and shedding read
    what is left of it.
    """

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class RouteTrace:
    """Why the request went where it did: for the access log."""

    profile: str
    score: float


@dataclass(slots=True)
class RequestContext:
    """Per-request state written by one stage and read by later ones (hooks, access log, limits)."""

    endpoint: str | None = None  # proxy: the endpoint of the latest attempt
    sent: bool = False  # proxy: the latest attempt held a connection to its replica (was sent)
    ttft_ms: float | None = None  # proxy: time to the first byte sent to the client
    usage: Usage | None = None  # proxy: from the engine's answer
    streamed_chunks: int = 0  # proxy: SSE data chunks passed to the client (a floor for usage)
    route: RouteTrace | None = None  # handler: the winning profile and score
    pd_decision: PDDecision | None = None  # scheduling: the P/D profile handler's verdict
    pd: PDState | None = None  # proxy: prefill legs of this request
    prefix: PrefixState | None = None  # prefix cache: block hashes, match, pending prefill
    session: SessionPin | None = None  # session affinity: the pin and whether it was usable
    latency: LatencySample | None = None  # latency model: features and prediction at send
    answer_head: bytes = b""  # proxy: the answer's first chunk (or body), for hooks that read ids
    at_cap: frozenset[str] = frozenset()  # handler: replicas left out at endpoint_max_concurrency


@dataclass(slots=True)
class InferenceRequest:
    """An API request parsed once; every later stage reads this, never the body again."""

    request_id: str
    api: ApiKind
    model: str
    body: dict[str, Any]
    raw_body: bytes
    stream: bool
    prompt_text: str
    est_prompt_tokens: int
    session_id: str | None = None
    priority: Priority = Priority.STANDARD
    tenant: str = "default"
    debug: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)
    slo: Slo | None = None  # parse: latency objectives and the first token's deadline
    path: str | None = None  # the upstream path when the route's differs from the API's (/rerank)
    form: Form | None = None  # multipart bodies (audio): their parts; ``body`` holds the text fields
    context: RequestContext = field(default_factory=RequestContext)

    @property
    def upstream_path(self) -> str:
        return self.path or self.api.upstream_path
