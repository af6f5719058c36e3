"""A steady, endless mix of requests for fault runs and soaks, as a :class:`Workload`.

Shared system prompts, streaming and not, chat and text completions, optional sessions
and priority classes. It is an ordinary workload: ``items()`` is the stream of requests
(endless unless ``requests`` is given) and ``next_turn`` is told every answer. Sessions
are a fixed pool: a session's next turn is whichever later request draws it again, and
it carries the answers so far; conversations restart after ``max_turns``, so a long soak
neither grows prompts without end nor mints session ids without end (either would grow
memory by design and hide a leak).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from typing import Any

from loadtest.workloads import PRIORITY_CLASSES, WorkItem, Workload, pseudo_text

__all__ = ["MixedWorkload"]


class MixedWorkload(Workload):
    name = "mixed"

    def __init__(
        self,
        *,
        stream_share: float = 0.5,
        completion_share: float = 0.0,
        session_share: float = 0.0,
        priority_share: float = 0.0,
        prefix_groups: int = 8,
        prefix_len: int = 120,
        question_len: int = 24,
        max_tokens: tuple[int, int] = (8, 40),
        sessions: int = 32,
        max_turns: int = 6,
        requests: int | None = None,
        **base: Any,
    ) -> None:
        super().__init__(**base)
        if completion_share + session_share > 1:
            raise ValueError("completion_share + session_share must be <= 1")
        self.stream_share = stream_share
        self.completion_share = completion_share
        self.session_share = session_share
        self.priority_share = priority_share
        self.prefix_groups = prefix_groups
        self.prefix_len = prefix_len
        self.question_len = question_len
        self.max_tokens = max_tokens
        self.sessions = sessions
        self.max_turns = max_turns
        self.requests = requests
        self._history: dict[str, list[dict[str, str]]] = {}

    @property
    def total_requests(self) -> int:
        return sys.maxsize if self.requests is None else self.requests

    def items(self) -> Iterator[WorkItem]:
        rng = random.Random(f"{self.seed}/mix")
        systems = [
            pseudo_text(random.Random(f"{self.seed}/system/{g}"), self.prefix_len)
            for g in range(self.prefix_groups)
        ]
        sent = 0
        while self.requests is None or sent < self.requests:
            sent += 1
            yield self._draw(rng, systems)

    def _draw(self, r: random.Random, systems: list[str]) -> WorkItem:
        stream = r.random() < self.stream_share
        body: dict[str, Any] = {"model": self.model, "max_tokens": r.randint(*self.max_tokens),
                                "stream": stream, "ignore_eos": True}  # fmt: skip
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers: dict[str, str] = {}
        priority = None
        if r.random() < self.priority_share:
            priority = r.choices(PRIORITY_CLASSES, weights=(1, 3, 1))[0]
            headers["x-priority"] = priority
        system = r.choice(systems)
        question = pseudo_text(r, self.question_len)
        roll = r.random()
        if roll < self.session_share:
            sid = f"s{self.seed}-{r.randrange(self.sessions)}"
            headers["x-session-id"] = sid
            past = self._history.get(sid) or [{"role": "system", "content": system}]
            body["messages"] = [*past, {"role": "user", "content": question}]
            return WorkItem("chat", body, headers, session_id=sid, priority=priority)
        if roll < self.session_share + self.completion_share:
            body["prompt"] = f"{system}\n\n{question}"
            return WorkItem("completion", body, headers, priority=priority)
        body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return WorkItem("chat", body, headers, priority=priority)

    def next_turn(self, item: WorkItem, answer_text: str) -> WorkItem | None:
        """Keep a session's answer, so the next request drawing it extends the conversation."""
        if item.session_id is not None:
            history = [*item.body["messages"], {"role": "assistant", "content": answer_text}]
            if sum(1 for m in history if m["role"] == "user") >= self.max_turns:
                self._history.pop(item.session_id, None)
            else:
                self._history[item.session_id] = history
        return None  # the session's next turn comes when a later request draws it
