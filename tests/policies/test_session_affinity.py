"""Scorer ``session-affinity``: the pinned replica scores 1 while it is a candidate with headroom.

Real SessionAffinity over a MemorySessionStore and signed SessionTokens; saturation is the
real SaturationDetector (queue threshold 5) reading real EndpointMetrics.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.config import ConfigError
from gateway.sessions.affinity import PinState
from gateway.sessions.store import SessionTokens
from policies.scorers import session_affinity
from tests.policies.helpers import endpoint, make_plugin, request, with_metrics
from tests.policies.services import services

SESSION = {"x-session-id": "conversation-1"}


def scorer_for(svc):
    return session_affinity.create("under-test", {}, svc.context)


async def scores(scorer, req, candidates):
    await scorer.prepare(req, candidates)
    return scorer.score(req, candidates)


async def test_pinned_replica_scores_one_the_rest_zero():
    svc = services()
    scorer = scorer_for(svc)
    a, b, c = endpoint(1), endpoint(2), endpoint(3)
    req = request(**SESSION)
    svc.store.pin(req.session_id, b.name)
    assert await scores(scorer, req, [a, b, c]) == {a: 0.0, b: 1.0, c: 0.0}
    assert req.context.session.pinned == b.name
    assert req.context.session.state is PinState.USABLE


async def test_no_session_scores_nobody():
    svc = services()
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    req = request()
    assert req.session_id is None
    assert await scores(scorer, req, [a, b]) == {a: 0.0, b: 0.0}
    assert req.context.session.pinned is None


async def test_unknown_session_scores_nobody():
    svc = services()
    scorer = scorer_for(svc)
    a = endpoint(1)
    svc.store.pin(request(**{"x-session-id": "someone-else"}).session_id, a.name)
    assert await scores(scorer, request(**SESSION), [a]) == {a: 0.0}


async def test_pinned_replica_not_a_candidate_is_gone():
    svc = services()
    scorer = scorer_for(svc)
    a, b, gone = endpoint(1), endpoint(2), endpoint(3)
    req = request(**SESSION)
    svc.store.pin(req.session_id, gone.name)
    assert await scores(scorer, req, [a, b]) == {a: 0.0, b: 0.0}
    assert req.context.session.state is PinState.GONE


async def test_saturated_pinned_replica_lets_the_session_move_when_another_has_headroom():
    svc = services(queue_depth_threshold=5)
    scorer = scorer_for(svc)
    roomy, full, pinned = endpoint(1), endpoint(2), endpoint(3)
    with_metrics(roomy, waiting=0, running=1, kv=0.1)
    with_metrics(full, waiting=9, running=10, kv=0.1)
    with_metrics(pinned, waiting=5, running=10, kv=0.1)
    req = request(**SESSION)
    svc.store.pin(req.session_id, pinned.name)
    assert await scores(scorer, req, [roomy, full, pinned]) == {roomy: 0.0, full: 0.0, pinned: 0.0}
    assert req.context.session.state is PinState.SATURATED


async def test_a_saturated_pin_stays_while_no_other_replica_is_known_to_have_headroom():
    """Moving to another saturated (or unknown) replica only trades the warm cache; the next
    turn would leave that one too, and sessions flapped between saturated replicas every turn."""
    svc = services(queue_depth_threshold=5)
    scorer = scorer_for(svc)
    full, unknown, pinned = endpoint(1), endpoint(2), endpoint(3)
    with_metrics(full, waiting=9, running=10, kv=0.1)
    with_metrics(unknown, waiting=0, kv=0.1, stale=True)
    with_metrics(pinned, waiting=5, running=10, kv=0.95)
    req = request(**SESSION)
    svc.store.pin(req.session_id, pinned.name)
    assert await scores(scorer, req, [full, unknown, pinned]) == {full: 0.0, unknown: 0.0, pinned: 1.0}
    assert req.context.session.state is PinState.USABLE


async def test_replica_just_below_saturation_keeps_its_session():
    svc = services(queue_depth_threshold=5)
    scorer = scorer_for(svc)
    a, pinned = endpoint(1), endpoint(2)
    with_metrics(pinned, waiting=4, running=10, kv=0.79)
    req = request(**SESSION)
    svc.store.pin(req.session_id, pinned.name)
    assert await scores(scorer, req, [a, pinned]) == {a: 0.0, pinned: 1.0}


async def test_stale_metrics_are_unknown_not_saturated():
    # Fail open: a replica whose scrape is stale keeps its sessions rather than losing them.
    svc = services(queue_depth_threshold=5)
    scorer = scorer_for(svc)
    pinned = endpoint(1)
    with_metrics(pinned, waiting=100, kv=1.0, stale=True)
    req = request(**SESSION)
    svc.store.pin(req.session_id, pinned.name)
    assert await scores(scorer, req, [pinned]) == {pinned: 1.0}


async def test_expired_pin_scores_nobody():
    svc = services(session_ttl_s=0.05)
    scorer = scorer_for(svc)
    a = endpoint(1)
    svc.store.pin(request(**SESSION).session_id, a.name)
    await asyncio.sleep(0.1)
    assert await scores(scorer, request(**SESSION), [a]) == {a: 0.0}


async def test_signed_token_pins_without_a_session_id():
    svc = services(token_header="x-session-token")
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    req = request(**{"x-session-token": svc.tokens.issue(b.name)})
    assert await scores(scorer, req, [a, b]) == {a: 0.0, b: 1.0}


@pytest.mark.parametrize(
    "token",
    ["bm90LW91cnM.0123456789abcdef0123456789abcdef", "garbage", ".", "MTAuMC4wLjI6ODAwMA."],
    ids=["forged-mac", "no-dot", "empty-parts", "no-mac"],
)
async def test_forged_token_pins_nothing(token):
    svc = services(token_header="x-session-token")
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    req = request(**{"x-session-token": token})
    assert await scores(scorer, req, [a, b]) == {a: 0.0, b: 0.0}


async def test_token_for_another_secret_pins_nothing():
    svc = services()
    scorer = scorer_for(svc)
    b = endpoint(2)
    foreign = SessionTokens("another-secret")  # another gateway deployment
    req = request(**{"x-session-token": foreign.issue(b.name)})
    assert await scores(scorer, req, [b]) == {b: 0.0}


async def test_token_is_ignored_when_tokens_are_off():
    svc = services(token_header=None)
    scorer = scorer_for(svc)
    b = endpoint(2)
    req = request(**{"x-session-token": svc.tokens.issue(b.name)})
    assert await scores(scorer, req, [b]) == {b: 0.0}


async def test_session_id_wins_over_a_token():
    svc = services(token_header="x-session-token")
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    req = request(**SESSION, **{"x-session-token": svc.tokens.issue(b.name)})
    svc.store.pin(req.session_id, a.name)
    assert await scores(scorer, req, [a, b]) == {a: 1.0, b: 0.0}


async def test_pin_is_looked_up_once_per_request():
    svc = services()
    scorer = scorer_for(svc)
    a, b = endpoint(1), endpoint(2)
    req = request(**SESSION)
    svc.store.pin(req.session_id, a.name)
    await scorer.prepare(req, [a, b])
    svc.store.pin(req.session_id, b.name)  # another request re-pins meanwhile
    await scorer.prepare(req, [a, b])  # a second profile prepares the same request
    assert scorer.score(req, [a, b]) == {a: 1.0, b: 0.0}


async def test_no_candidates_scores_nothing():
    svc = services()
    scorer = scorer_for(svc)
    req = request(**SESSION)
    svc.store.pin(req.session_id, endpoint(1).name)
    assert await scores(scorer, req, []) == {}


@pytest.mark.parametrize("params", [{"weight": 1}, {"ttl_s": 60}])
def test_takes_no_parameters(params):
    key = next(iter(params))
    with pytest.raises(ValueError, match=rf"parameters\.{key}: unknown parameter"):
        session_affinity.create("under-test", params, services().context)
    with pytest.raises(ConfigError, match=rf"plugins\.0\.parameters\.{key}"):
        make_plugin("session-affinity", params)
