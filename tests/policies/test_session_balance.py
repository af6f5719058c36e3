"""Scorer ``session-balance``: a session without a usable pin goes where the fewest live sessions are.

Real SessionAffinity (its SessionPlacement counts what was sent) over a MemorySessionStore.
"""

from __future__ import annotations

from policies.scorers import session_balance
from tests.policies.helpers import endpoint, request
from tests.policies.services import services


async def scores(scorer, req, candidates):
    await scorer.prepare(req, candidates)
    return scorer.score(req, candidates)


async def test_a_new_session_prefers_the_replica_with_fewest_live_sessions():
    svc = services()
    scorer = session_balance.create("under-test", {}, svc.context)
    a, b, c = endpoint(1), endpoint(2), endpoint(3)
    placement = svc.context.sessions.placement
    for i in range(4):
        placement.place(f"s{i}", a.name)
    placement.place("s4", b.name)
    placement.place("s5", b.name)
    assert await scores(scorer, request(**{"x-session-id": "new"}), [a, b, c]) == {a: 0.0, b: 0.5, c: 1.0}


async def test_equal_counts_pinned_sessions_and_session_less_requests_score_nothing():
    svc = services()
    scorer = session_balance.create("under-test", {}, svc.context)
    a, b = endpoint(1), endpoint(2)
    placement = svc.context.sessions.placement
    placement.place("x", a.name)
    placement.place("y", b.name)
    assert await scores(scorer, request(**{"x-session-id": "new"}), [a, b]) == {}  # 1 and 1
    placement.place("z", a.name)
    assert await scores(scorer, request(), [a, b]) == {}  # no session id
    svc.store.pin(request(**{"x-session-id": "x"}).session_id, a.name)
    # a usable pin: session-affinity keeps the conversation there, balance stays out
    assert await scores(scorer, request(**{"x-session-id": "x"}), [a, b]) == {}
    # the same session whose replica left the candidates moves, and is balanced as a new one
    c = endpoint(3)
    assert await scores(scorer, request(**{"x-session-id": "x"}), [b, c]) == {b: 0.0, c: 1.0}
