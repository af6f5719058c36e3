"""New sessions are spread by live sessions per replica, not only by their first prompt.

Agents start together with one long shared system prompt: after the first turn every replica
may hold that prompt, and prefix scoring alone placed 7 of 12 sessions on one of two real vLLM
replicas (docs/benchmarks.md §10), which then evicted first as the histories grew.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from gateway.sessions.placement import SessionPlacement
from tests.sessions.conftest import started_gateway, turn

SYSTEM = "you are a coding agent; the repository's rules follow. " * 60  # ~12 prefix blocks


async def test_sessions_that_start_together_are_split_evenly(
    start_sims, start_gateway, openai_client
) -> None:
    sims = await start_sims(2, time_scale=10.0)
    gw = await started_gateway(start_gateway, [s.url for s in sims])
    client = openai_client(gw)
    # One session first, so that its replica holds the shared prompt before the rest start.
    first, _ = await turn(client, headers={"x-session-id": "agent-0"}, messages=_messages(0))
    rest = await asyncio.gather(
        *(turn(client, headers={"x-session-id": f"agent-{i}"}, messages=_messages(i)) for i in range(1, 12))
    )
    placed = Counter([first, *(endpoint for endpoint, _ in rest)])
    assert sorted(placed.values()) == [6, 6], placed
    # and a pinned session still sticks: its next turn goes where its first did
    again, _ = await turn(client, headers={"x-session-id": "agent-0"}, messages=_messages(0, turns=2))
    assert again == first


def _messages(session: int, turns: int = 1) -> list[dict[str, str]]:
    out = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        out.append({"role": "user", "content": f"session {session} turn {t}: fix the failing test"})
        out.append({"role": "assistant", "content": "done"})
    return out[:-1]


def test_a_session_counts_once_where_its_latest_request_went() -> None:
    placement = SessionPlacement(ttl_s=60.0, max_sessions=3)
    placement.place("a", "r1")
    placement.place("b", "r1")
    placement.place("a", "r2")  # a moved
    assert (placement.live("r1"), placement.live("r2")) == (1, 1)
    placement.place("c", "r2")
    placement.place("d", "r2")  # over max_sessions: the least recently seen ("b") is forgotten
    assert (placement.live("r1"), placement.live("r2")) == (0, 3)


def test_sessions_not_seen_within_the_ttl_are_not_counted() -> None:
    placement = SessionPlacement(ttl_s=0.05, max_sessions=10)
    placement.place("a", "r1")
    placement.place("b", "r1")
    time.sleep(0.06)
    placement.place("c", "r1")
    assert placement.live("r1") == 1
    assert placement.live("r2") == 0
