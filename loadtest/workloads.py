"""Seeded, reproducible benchmark workloads.

Every workload is a pure function of its parameters and seed: the same
``(name, params, seed)`` yields byte-identical request bodies, so runs against
different targets (direct round-robin, gateway, peer router) see the same
traffic.  A "token" is approximated by one pseudo-word; the simulator and real
tokenizers map a pseudo-word to roughly one to three tokens, which is close
enough for prefix-sharing shapes (what matters is *which* bytes are shared).

Multi-turn conversations depend on the server's answers, so a workload exposes
:meth:`Workload.next_turn`; the runner sends turn ``n+1`` of a session only
after turn ``n`` finished and feeds back the assistant text it received.
"""

from __future__ import annotations

import inspect
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

__all__ = [
    "PRIORITY_CLASSES",
    "WORKLOADS",
    "BurstWorkload",
    "MultiTurnWorkload",
    "ShareGPTLikeWorkload",
    "SharedPrefixWorkload",
    "WorkItem",
    "Workload",
    "make_workload",
    "pseudo_text",
]

Kind = Literal["chat", "completion"]
PRIORITY_CLASSES: tuple[str, ...] = ("critical", "standard", "sheddable")


@dataclass(slots=True)
class WorkItem:
    """One request to send; ``body`` is a ready-to-post OpenAI request body."""

    kind: Kind
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    session_id: str | None = None
    group: int | None = None
    turn: int = 0
    priority: str | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def path(self) -> str:
        """API path relative to a ``/v1``-less base URL."""
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"


# --------------------------------------------------------------------------- text


def _build_vocab(size: int = 4096) -> tuple[str, ...]:
    """Fixed pseudo-word vocabulary (independent of any workload seed)."""
    rng = random.Random(0x5EED)
    onsets = "b c d f g h j k l m n p r s t v w z br cr dr fr gr pl st tr".split()
    vowels = "a e i o u ai ea io ou".split()
    words: set[str] = set()
    while len(words) < size:
        n = rng.choice((1, 2, 2, 3))
        words.add("".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(n)))
    return tuple(sorted(words))


_VOCAB = _build_vocab()


def pseudo_text(rng: random.Random, n_tokens: int) -> str:
    """``n_tokens`` space-separated pseudo-words drawn from ``rng``."""
    return " ".join(rng.choices(_VOCAB, k=max(0, n_tokens)))


def _scaled(value: int, scale: float, minimum: int = 1) -> int:
    return max(minimum, round(value * scale))


def _sub_rng(seed: int, *parts: object) -> random.Random:
    """Independent RNG per (seed, parts) so content never depends on send order."""
    return random.Random("/".join(str(p) for p in (seed, *parts)))


# --------------------------------------------------------------------------- base


class Workload(ABC):
    """A reproducible stream of requests.

    ``items()`` yields the *first* request of every session in send order (for
    single-shot workloads that is every request).  ``next_turn`` returns the
    follow-up of a finished request or ``None``.
    """

    name: ClassVar[str]

    def __init__(
        self, *, model: str = "default", seed: int = 0, scale: float = 1.0, api: Kind = "chat"
    ) -> None:
        if api not in ("chat", "completion"):
            raise ValueError(f"api must be 'chat' or 'completion', not {api!r}")
        if not (isinstance(scale, int | float) and scale > 0 and math.isfinite(scale)):
            raise ValueError(f"scale must be a positive finite number, not {scale!r}")
        self.model = model
        self.seed = int(seed)
        self.scale = float(scale)
        self.api: Kind = api
        #: suggested open-loop arrival rate (req/s) when the caller gives none.
        self.default_rate: float | None = None

    @abstractmethod
    def items(self) -> Iterator[WorkItem]:
        """First request of each session, in deterministic send order."""

    @property
    @abstractmethod
    def total_requests(self) -> int:
        """Planned number of requests including follow-up turns."""

    def next_turn(self, item: WorkItem, answer_text: str) -> WorkItem | None:
        """Follow-up request after ``item`` completed with ``answer_text``."""
        return None

    def params(self) -> dict[str, Any]:
        """Constructor parameters, for reports (so a run can be reproduced)."""
        return {k: getattr(self, k) for k in sorted(_accepted_params(type(self))) if hasattr(self, k)}

    # helpers ---------------------------------------------------------------
    def _body(self, max_tokens: int, *, system: str | None, user: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model}
        if self.api == "chat":
            msgs = [{"role": "system", "content": system}] if system is not None else []
            body["messages"] = [*msgs, {"role": "user", "content": user}]
        else:
            body["prompt"] = f"{system}\n\n{user}" if system is not None else user
        body.update(
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            ignore_eos=True,  # fixed output lengths, as SGLang/vLLM benchmarks do
        )
        return body


def _check_positive(**values: float) -> None:
    for key, value in values.items():
        if not (isinstance(value, int | float) and value > 0):
            raise ValueError(f"{key} must be > 0, not {value!r}")


# --------------------------------------------------------------------------- workloads


class SharedPrefixWorkload(Workload):
    """SGLang ``generated-shared-prefix`` shape: G groups share an S-token system prompt.

    Groups are interleaved in seeded random order so a prefix-blind router
    scatters each group over all replicas while a prefix-aware one keeps it.
    """

    name = "shared-prefix"

    def __init__(
        self,
        *,
        num_groups: int = 64,
        prompts_per_group: int = 16,
        system_prompt_len: int = 2048,
        question_len: int = 128,
        output_len: int = 256,
        **base: Any,
    ) -> None:
        super().__init__(**base)
        _check_positive(num_groups=num_groups, prompts_per_group=prompts_per_group)
        _check_positive(system_prompt_len=system_prompt_len, question_len=question_len, output_len=output_len)
        self.num_groups = int(num_groups)
        self.prompts_per_group = int(prompts_per_group)
        self.system_prompt_len = int(system_prompt_len)
        self.question_len = int(question_len)
        self.output_len = int(output_len)

    @property
    def total_requests(self) -> int:
        return self.num_groups * self.prompts_per_group

    def system_prompt(self, group: int) -> str:
        rng = _sub_rng(self.seed, "system", group)
        return pseudo_text(rng, _scaled(self.system_prompt_len, self.scale))

    def items(self) -> Iterator[WorkItem]:
        systems = [self.system_prompt(g) for g in range(self.num_groups)]
        order = [(g, p) for g in range(self.num_groups) for p in range(self.prompts_per_group)]
        random.Random(f"{self.seed}/order").shuffle(order)
        q_len = _scaled(self.question_len, self.scale)
        out_len = _scaled(self.output_len, self.scale)
        for g, p in order:
            question = pseudo_text(_sub_rng(self.seed, "question", g, p), q_len)
            body = self._body(out_len, system=systems[g], user=question)
            yield WorkItem(self.api, body, {}, session_id=None, group=g, turn=0)


class MultiTurnWorkload(Workload):
    """vLLM production-stack multi-round QA: U users x R rounds over a shared system prompt.

    Each user has a private history block; every turn appends the real assistant
    answer plus a new question, so turn ``n+1`` extends turn ``n``'s messages.
    """

    name = "multi-turn"

    def __init__(
        self,
        *,
        num_users: int = 16,
        num_rounds: int = 5,
        system_prompt_len: int = 1000,
        history_len: int = 2000,
        question_len: int = 32,
        answer_len: int = 100,
        **base: Any,
    ) -> None:
        super().__init__(**base)
        if self.api != "chat":
            raise ValueError("multi-turn only supports api='chat'")
        _check_positive(num_users=num_users, num_rounds=num_rounds, system_prompt_len=system_prompt_len)
        _check_positive(history_len=history_len, question_len=question_len, answer_len=answer_len)
        self.num_users = int(num_users)
        self.num_rounds = int(num_rounds)
        self.system_prompt_len = int(system_prompt_len)
        self.history_len = int(history_len)
        self.question_len = int(question_len)
        self.answer_len = int(answer_len)

    @property
    def total_requests(self) -> int:
        return self.num_users * self.num_rounds

    def _session(self, user: int) -> str:
        return f"user-{self.seed}-{user}"

    def _question(self, user: int, turn: int) -> str:
        rng = _sub_rng(self.seed, "question", user, turn)
        return f"Question {turn + 1}: " + pseudo_text(rng, _scaled(self.question_len, self.scale))

    def _item(self, user: int, turn: int, messages: list[dict[str, str]]) -> WorkItem:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": _scaled(self.answer_len, self.scale),
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "user": self._session(user),
        }
        sid = self._session(user)
        return WorkItem("chat", body, {"x-session-id": sid}, session_id=sid, group=user, turn=turn)

    def items(self) -> Iterator[WorkItem]:
        system = pseudo_text(_sub_rng(self.seed, "system"), _scaled(self.system_prompt_len, self.scale))
        for user in range(self.num_users):
            history = pseudo_text(_sub_rng(self.seed, "history", user), _scaled(self.history_len, self.scale))
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"{history}\n\n{self._question(user, 0)}"},
            ]
            yield self._item(user, 0, messages)

    def next_turn(self, item: WorkItem, answer_text: str) -> WorkItem | None:
        turn = item.turn + 1
        if turn >= self.num_rounds or item.group is None:
            return None
        messages = [
            *item.body["messages"],
            {"role": "assistant", "content": answer_text},
            {"role": "user", "content": self._question(item.group, turn)},
        ]
        return self._item(item.group, turn, messages)


class BurstWorkload(Workload):
    """Mixed-priority overload: ``x-priority`` classes in fixed proportions.

    Meant to be sent at ``overload`` x fleet capacity (``default_rate`` when
    ``capacity_rps`` is known) to exercise shedding and priority scheduling.
    """

    name = "burst"

    def __init__(
        self,
        *,
        num_requests: int = 512,
        critical: float = 0.2,
        standard: float = 0.5,
        sheddable: float = 0.3,
        prompt_len: int = 256,
        output_len: int = 128,
        overload: float = 3.0,
        capacity_rps: float | None = None,
        **base: Any,
    ) -> None:
        super().__init__(**base)
        _check_positive(num_requests=num_requests, prompt_len=prompt_len, output_len=output_len)
        _check_positive(overload=overload)
        shares = {"critical": critical, "standard": standard, "sheddable": sheddable}
        if any(not isinstance(v, int | float) or v < 0 for v in shares.values()) or sum(shares.values()) <= 0:
            raise ValueError(f"priority proportions must be >= 0 with a positive sum: {shares}")
        if capacity_rps is not None:
            _check_positive(capacity_rps=capacity_rps)
        self.num_requests = int(num_requests)
        total = sum(shares.values())
        self.critical, self.standard, self.sheddable = (shares[k] / total for k in PRIORITY_CLASSES)
        self.prompt_len = int(prompt_len)
        self.output_len = int(output_len)
        self.overload = float(overload)
        self.capacity_rps = capacity_rps
        if capacity_rps is not None:
            self.default_rate = self.overload * capacity_rps

    @property
    def total_requests(self) -> int:
        return self.num_requests

    def priorities(self) -> list[str]:
        """Exact class counts (largest-remainder rounding), shuffled by seed."""
        shares = (self.critical, self.standard, self.sheddable)
        raw = [s * self.num_requests for s in shares]
        counts = [math.floor(r) for r in raw]
        by_remainder = sorted(range(3), key=lambda i: raw[i] - counts[i], reverse=True)
        for i in by_remainder[: self.num_requests - sum(counts)]:
            counts[i] += 1
        labels = [c for c, n in zip(PRIORITY_CLASSES, counts, strict=True) for _ in range(n)]
        random.Random(f"{self.seed}/priorities").shuffle(labels)
        return labels

    def items(self) -> Iterator[WorkItem]:
        p_len = _scaled(self.prompt_len, self.scale)
        out_len = _scaled(self.output_len, self.scale)
        for i, prio in enumerate(self.priorities()):
            prompt = pseudo_text(_sub_rng(self.seed, "burst", i), p_len)
            body = self._body(out_len, system=None, user=prompt)
            yield WorkItem(self.api, body, {"x-priority": prio}, priority=prio)


class ShareGPTLikeWorkload(Workload):
    """Control case: lognormal prompt/output lengths and no shared prefixes."""

    name = "sharegpt-like"

    def __init__(
        self,
        *,
        num_requests: int = 1000,
        mean_input_len: int = 220,
        mean_output_len: int = 200,
        sigma: float = 0.8,
        **base: Any,
    ) -> None:
        super().__init__(**base)
        _check_positive(num_requests=num_requests, mean_input_len=mean_input_len)
        _check_positive(mean_output_len=mean_output_len, sigma=sigma)
        self.num_requests = int(num_requests)
        self.mean_input_len = int(mean_input_len)
        self.mean_output_len = int(mean_output_len)
        self.sigma = float(sigma)

    @property
    def total_requests(self) -> int:
        return self.num_requests

    def _length(self, rng: random.Random, mean: int) -> int:
        mean_scaled = max(1.0, mean * self.scale)
        mu = math.log(mean_scaled) - self.sigma**2 / 2  # so that E[X] == mean
        return int(min(max(1, round(rng.lognormvariate(mu, self.sigma))), 8 * mean_scaled))

    def items(self) -> Iterator[WorkItem]:
        for i in range(self.num_requests):
            rng = _sub_rng(self.seed, "sharegpt", i)
            in_len = self._length(rng, self.mean_input_len)
            out_len = self._length(rng, self.mean_output_len)
            body = self._body(out_len, system=None, user=pseudo_text(rng, in_len))
            yield WorkItem(self.api, body, {})


WORKLOADS: dict[str, type[Workload]] = {
    cls.name: cls for cls in (SharedPrefixWorkload, MultiTurnWorkload, BurstWorkload, ShareGPTLikeWorkload)
}


def _accepted_params(cls: type[Workload]) -> set[str]:
    names: set[str] = set()
    for klass in (cls, Workload):
        sig = inspect.signature(klass.__init__)
        names |= {p.name for p in sig.parameters.values() if p.name != "self" and p.kind is p.KEYWORD_ONLY}
    return names


def make_workload(name: str, **params: Any) -> Workload:
    """Build a workload by name, rejecting unknown names and parameters early."""
    try:
        cls = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}") from None
    unknown = set(params) - _accepted_params(cls)
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {sorted(unknown)} for workload {name!r}; "
            f"accepted: {sorted(_accepted_params(cls))}"
        )
    return cls(**params)
