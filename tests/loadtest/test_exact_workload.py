"""exact_bench's workload as its workers drive it: several requests in flight, answered in any
order. A conversation in flight is never drawn again (nor changed) before its answer lands, so
every prompt alternates user and assistant turns after the system document."""

from __future__ import annotations

import random

from loadtest.exact_bench import Workload

Prompt = tuple[int, list[dict[str, str]]]


def _drive(work: Workload, requests: int, concurrency: int, seed: int) -> list[Prompt]:
    """The bench's workers, without a network: ``concurrency`` in flight, answered at random."""
    rng = random.Random(seed)
    in_flight: list[Prompt] = []
    busy: set[int] = set()
    sent = []
    for turn in range(requests):
        if len(in_flight) >= concurrency:
            cid, conversation = in_flight.pop(rng.randrange(len(in_flight)))
            busy.discard(cid)
            conversation.append({"role": "assistant", "content": f"answer {cid}"})
        cid, messages = work.next(turn, busy)
        assert cid not in busy, f"turn {turn}: conversation {cid} sent while in flight"
        busy.add(cid)
        in_flight.append((cid, work.conversations[cid]))
        sent.append((cid, messages))
    return sent


def test_no_conversation_is_sent_while_in_flight_and_turns_alternate() -> None:
    work = Workload(docs=16, doc_tokens=20, active=24)
    sent = _drive(work, requests=600, concurrency=6, seed=5)
    for cid, messages in sent:
        roles = [m["role"] for m in messages]
        assert roles[0] == "system"
        assert roles[1:] == ["user", "assistant"] * (len(roles) // 2 - 1) + ["user"], (cid, roles)
    by_conversation: dict[int, int] = {}
    for cid, messages in sent:  # each turn of a conversation extends its previous prompt by one answer
        turns = len(messages)
        assert turns == by_conversation.get(cid, 0) + 2
        by_conversation[cid] = turns
    assert len(work.conversations) <= 24
    assert len(by_conversation) > 24  # conversations retire and new ones start


def test_more_workers_than_conversations_still_draws_an_idle_one() -> None:
    work = Workload(docs=4, doc_tokens=10, active=2)
    sent = _drive(work, requests=50, concurrency=4, seed=1)
    assert len(sent) == 50


def test_a_conversation_past_max_words_starts_over_on_its_document() -> None:
    work = Workload(docs=4, doc_tokens=100, active=3, max_words=400)
    sent = _drive(work, requests=300, concurrency=2, seed=7)
    assert max(sum(len(m["content"].split()) for m in messages) for _, messages in sent) <= 400
    for _, messages in sent:  # a new conversation keeps its document
        assert messages[0]["content"].startswith("Document ")
