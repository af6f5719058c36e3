"""``gateway.proxy.hooks``: the hook chain and each built-in hook, on real services.

Real PrefixCache / MemoryPrefixIndex, SessionAffinity / MemorySessionStore, CircuitBreakers
over an EndpointRegistry and a HealthTracker; the last tests go through a real gateway.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.config import HealthConfig, ResilienceConfig
from gateway.fleet.health import HealthTracker
from gateway.fleet.registry import EndpointRegistry
from gateway.proxy.hooks import (
    BreakerHook,
    HookChain,
    InFlightHook,
    Outcome,
    PassiveHealthHook,
    PrefixHook,
    RequestHooks,
    SessionHook,
)
from gateway.proxy.resilience import BreakerState, CircuitBreakers
from gateway.request.types import Usage
from gateway.sessions.affinity import PinState
from tests.policies.helpers import endpoint, request
from tests.policies.services import blocks_prompt, services
from tests.support.harness import chat_body, wait_until

OK = Outcome(True, "ok")
FAILED = Outcome(False, "http_503")
CANCELLED = Outcome(False, None)  # the client left: says nothing about the endpoint
SESSION = {"x-session-id": "conversation-1"}


def sample(svc, name: str, **labels: str) -> float:
    return svc.metrics.registry.get_sample_value(name, labels) or 0.0


# -- HookChain ------------------------------------------------------------------------------


class Recorder(RequestHooks):
    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name = name
        self.log = log

    def on_send(self, request, endpoint):
        self.log.append(("send", self.name))

    def on_headers(self, request, endpoint, headers):
        self.log.append(("headers", self.name))
        headers[f"x-{self.name}"] = ",".join(sorted(headers))  # what it saw before itself

    def on_first_byte(self, request, endpoint):
        self.log.append(("first_byte", self.name))

    def on_usage(self, request, endpoint, usage):
        self.log.append(("usage", self.name))

    def on_done(self, request, endpoint, outcome):
        self.log.append(("done", self.name))


def test_chain_sends_in_order_and_runs_the_rest_in_reverse():
    log: list[tuple[str, str]] = []
    chain = HookChain([Recorder("a", log), RequestHooks(), Recorder("b", log), Recorder("c", log)])
    req, e = request(), endpoint(1)
    headers: dict[str, str] = {}
    chain.on_send(req, e)
    chain.on_headers(req, e, headers)
    chain.on_first_byte(req, e)
    chain.on_usage(req, e, Usage(10, 2))
    chain.on_done(req, e, OK)
    by_event: dict[str, list[str]] = {}
    for event, name in log:
        by_event.setdefault(event, []).append(name)
    assert by_event == {
        "send": ["a", "b", "c"],
        "headers": ["c", "b", "a"],
        "first_byte": ["c", "b", "a"],
        "usage": ["c", "b", "a"],
        "done": ["c", "b", "a"],
    }
    # One headers dict goes through the chain: the outermost hook sees what inner ones added.
    assert headers == {"x-c": "", "x-b": "x-c", "x-a": "x-b,x-c"}


def test_empty_chain_is_a_no_op():
    chain = HookChain([])
    e = endpoint(1)
    chain.on_send(request(), e)
    chain.on_done(request(), e, OK)
    assert (e.in_flight, e.pending_prefill_tokens) == (0, 0.0)


# -- InFlightHook ---------------------------------------------------------------------------


@pytest.mark.parametrize("outcome", [OK, FAILED, CANCELLED], ids=["ok", "failed", "cancelled"])
def test_in_flight_counts_balance_whatever_the_outcome(outcome):
    hook = InFlightHook()
    a, b = endpoint(1), endpoint(2)
    small, big = request(text="x" * 40), request(text="y" * 400)
    hook.on_send(small, a)
    hook.on_send(big, a)
    hook.on_send(small, b)
    assert (a.in_flight, a.in_flight_tokens) == (2, small.est_prompt_tokens + big.est_prompt_tokens)
    assert (b.in_flight, b.in_flight_tokens) == (1, small.est_prompt_tokens)
    hook.on_first_byte(small, a)  # nothing but on_done gives a request back
    hook.on_usage(small, a, Usage(1, 1))
    assert a.in_flight == 2
    hook.on_done(small, a, outcome)
    assert (a.in_flight, a.in_flight_tokens) == (1, big.est_prompt_tokens)
    hook.on_done(big, a, outcome)
    hook.on_done(small, b, outcome)
    assert (a.in_flight, a.in_flight_tokens, b.in_flight, b.in_flight_tokens) == (0, 0, 0, 0)


# -- PrefixHook -----------------------------------------------------------------------------


async def test_prefix_hook_records_on_send():
    svc = services()
    hook = PrefixHook(svc.prefix, svc.metrics)
    e = endpoint(1)
    req = blocks_prompt(6)
    hook.on_send(req, e)  # before any answer: the replica starts caching as it prefills
    assert await svc.index.match(svc.prefix.hashes(req), [e.name]) == {e.name: 6}


def test_pending_prefill_is_the_uncached_part_and_released_on_first_byte():
    svc = services()
    hook = PrefixHook(svc.prefix, svc.metrics)
    e = endpoint(1)
    req = blocks_prompt(10)
    hook.on_send(req, e)
    assert e.pending_prefill_tokens == 160
    assert req.context.prefix.pending == {e: 160}
    hook.on_first_byte(req, e)
    assert e.pending_prefill_tokens == 0
    assert req.context.prefix.pending == {}
    hook.on_done(req, e, OK)
    assert e.pending_prefill_tokens == 0


async def test_cached_prompt_adds_no_pending_prefill():
    svc = services()
    hook = PrefixHook(svc.prefix, svc.metrics)
    e = endpoint(1)
    req = blocks_prompt(10)
    svc.prefix.record(req, e)
    await svc.prefix.match(req, [e])
    hook.on_send(req, e)
    assert e.pending_prefill_tokens == 0


@pytest.mark.parametrize("outcome", [OK, FAILED, CANCELLED], ids=["ok", "failed", "cancelled"])
def test_pending_prefill_is_released_exactly_once_per_request(outcome):
    svc = services()
    hook = PrefixHook(svc.prefix, svc.metrics)
    e = endpoint(1)
    first, second = blocks_prompt(10, "a"), blocks_prompt(5, "b")
    hook.on_send(first, e)
    hook.on_send(second, e)
    assert e.pending_prefill_tokens == 160 + 80
    hook.on_first_byte(first, e)
    assert e.pending_prefill_tokens == 80
    hook.on_first_byte(first, e)
    hook.on_done(first, e, outcome)  # already released: must not take the other request's share
    assert e.pending_prefill_tokens == 80
    hook.on_done(second, e, outcome)  # never answered: released on done
    assert e.pending_prefill_tokens == 0
    hook.on_done(second, e, outcome)
    assert e.pending_prefill_tokens == 0


def test_a_retry_elsewhere_releases_each_endpoints_share():
    svc = services()
    hook = PrefixHook(svc.prefix, svc.metrics)
    dead, alive = endpoint(1), endpoint(2)
    req = blocks_prompt(10)
    hook.on_send(req, dead)
    hook.on_done(req, dead, Outcome(False, "connect"))
    hook.on_send(req, alive)
    assert (dead.pending_prefill_tokens, alive.pending_prefill_tokens) == (0, 160)
    hook.on_first_byte(req, alive)
    hook.on_done(req, alive, OK)
    assert (dead.pending_prefill_tokens, alive.pending_prefill_tokens) == (0, 0)


def test_release_of_an_unknown_request_is_harmless():
    svc = services()
    hook = PrefixHook(svc.prefix, svc.metrics)
    e = endpoint(1)
    e.pending_prefill_tokens = 42.0  # someone else's
    hook.on_first_byte(request(), e)  # this request never went through on_send
    hook.on_done(request(), e, OK)
    assert e.pending_prefill_tokens == 42.0


async def test_sending_past_the_best_match_counts_a_load_override():
    svc = services()
    hook = PrefixHook(svc.prefix, svc.metrics)
    warm, cold = endpoint(1), endpoint(2)
    svc.prefix.record(blocks_prompt(8), warm)
    name = "llm_gateway_affinity_overridden_by_load_total"

    to_warm = blocks_prompt(8)
    await svc.prefix.match(to_warm, [warm, cold])
    hook.on_send(to_warm, warm)
    assert sample(svc, name) == 0

    to_cold = blocks_prompt(8)
    await svc.prefix.match(to_cold, [warm, cold])
    hook.on_send(to_cold, cold)
    assert sample(svc, name) == 1

    unmatched = blocks_prompt(8)  # no prefix scorer matched it: no verdict on the choice
    hook.on_send(unmatched, cold)
    assert sample(svc, name) == 1


async def test_prefill_leg_hook_does_not_count_overrides():
    svc = services()
    hook = PrefixHook(svc.prefix, svc.metrics, count_overrides=False)
    warm, cold = endpoint(1), endpoint(2)
    svc.prefix.record(blocks_prompt(8), warm)
    req = blocks_prompt(8)
    await svc.prefix.match(req, [warm, cold])
    hook.on_send(req, cold)
    assert sample(svc, "llm_gateway_affinity_overridden_by_load_total") == 0
    assert cold.pending_prefill_tokens == 128  # the accounting itself is the same


async def test_usage_feeds_the_capacity_loop():
    svc = services(capacity_blocks=1000)
    hook = PrefixHook(svc.prefix, svc.metrics)
    e = endpoint(1)
    req = blocks_prompt(10)
    svc.prefix.record(req, e)
    await svc.prefix.match(req, [e])
    hook.on_send(req, e)
    hook.on_usage(req, e, Usage(prompt_tokens=160, completion_tokens=5, cached_tokens=0))
    assert svc.prefix.capacity(e) == 900  # predicted a full hit, the replica had nothing
    assert sample(svc, "llm_gateway_observed_prompt_tokens_total") == 160


# -- SessionHook ----------------------------------------------------------------------------


async def looked_up(svc, req, candidates):
    await svc.sessions.lookup(req)
    svc.sessions.usable_pin(req, candidates)
    return req


async def test_session_is_pinned_on_first_byte_not_on_send():
    svc = services()
    hook = SessionHook(svc.sessions)
    e = endpoint(1)
    req = await looked_up(svc, request(**SESSION), [e])
    hook.on_send(req, e)
    assert svc.store.get_now(req.session_id) is None
    hook.on_first_byte(req, e)
    assert svc.store.get_now(req.session_id) == e.name


async def test_a_failed_attempt_pins_nothing():
    svc = services()
    hook = SessionHook(svc.sessions)
    e = endpoint(1)
    req = await looked_up(svc, request(**SESSION), [e])
    hook.on_send(req, e)
    hook.on_done(req, e, Outcome(False, "connect"))
    assert svc.store.get_now(req.session_id) is None


async def test_failure_of_the_pinned_replica_marks_the_pin_gone_and_the_move_counted():
    svc = services()
    hook = SessionHook(svc.sessions)
    pinned, other = endpoint(1), endpoint(2)
    req = request(**SESSION)
    svc.store.pin(req.session_id, pinned.name)
    await looked_up(svc, req, [pinned, other])
    assert req.context.session.state is PinState.USABLE
    hook.on_done(req, pinned, Outcome(False, "connect"))
    assert req.context.session.state is PinState.GONE
    hook.on_first_byte(req, other)  # the retry answered
    hook.on_done(req, other, OK)
    assert svc.store.get_now(req.session_id) == other.name
    assert sample(svc, "llm_gateway_session_moves_total", reason="gone") == 1
    assert sample(svc, "llm_gateway_session_hits_total") == 0


@pytest.mark.parametrize("outcome", [OK, Outcome(True, None)], ids=["ok", "ok-without-verdict"])
async def test_only_a_failure_of_the_pinned_replica_changes_the_pin_state(outcome):
    svc = services()
    hook = SessionHook(svc.sessions)
    pinned, other = endpoint(1), endpoint(2)
    req = request(**SESSION)
    svc.store.pin(req.session_id, pinned.name)
    await looked_up(svc, req, [pinned, other])
    hook.on_done(req, other, Outcome(False, "http_503"))  # not the pinned one
    assert req.context.session.state is PinState.USABLE
    hook.on_done(req, pinned, outcome)
    assert req.context.session.state is PinState.USABLE


async def test_answer_from_the_pinned_replica_is_a_hit():
    svc = services()
    hook = SessionHook(svc.sessions)
    pinned = endpoint(1)
    req = request(**SESSION)
    svc.store.pin(req.session_id, pinned.name)
    await looked_up(svc, req, [pinned])
    hook.on_first_byte(req, pinned)
    assert sample(svc, "llm_gateway_session_hits_total") == 1


async def test_without_a_lookup_the_session_hook_does_nothing():
    svc = services()
    hook = SessionHook(svc.sessions)
    e = endpoint(1)
    req = request(**SESSION)  # no session-affinity scorer in the policy
    headers: dict[str, str] = {}
    hook.on_headers(req, e, headers)
    hook.on_first_byte(req, e)
    assert headers == {}
    assert svc.store.get_now(req.session_id) is None


async def test_headers_carry_a_signed_token_for_the_answering_replica():
    svc = services(token_header="x-session-token")
    hook = SessionHook(svc.sessions)
    e = endpoint(3)
    req = await looked_up(svc, request(), [e])
    headers: dict[str, str] = {"content-type": "text/event-stream"}
    hook.on_headers(req, e, headers)
    assert svc.tokens.verify(headers["x-session-token"]) == e.name
    assert headers["content-type"] == "text/event-stream"


# -- BreakerHook on real CircuitBreakers ------------------------------------------------------


def breaker_fixture(**resilience):
    svc = services()
    a, b = endpoint(1), endpoint(2)
    registry = EndpointRegistry([a, b])
    config = ResilienceConfig(**{"consecutive_failures": 3, "ejection_s": 1.0, **resilience})
    breakers = CircuitBreakers(config, registry, svc.metrics)
    return svc, breakers, BreakerHook(breakers), a


def attempt(hook: BreakerHook, e, verdict: str | None) -> None:
    req = request()
    hook.on_send(req, e)
    hook.on_done(req, e, Outcome(verdict == "ok", verdict))


def test_failure_verdicts_eject_after_the_threshold():
    svc, breakers, hook, a = breaker_fixture()
    for _ in range(2):
        attempt(hook, a, "http_500")
    assert breakers.state(a) is BreakerState.CLOSED
    attempt(hook, a, "http_500")
    assert breakers.state(a) is BreakerState.OPEN
    assert a.ejected
    assert sample(svc, "llm_gateway_endpoint_ejections_total", endpoint=a.name, reason="http_500") == 1


def test_ok_verdict_resets_the_failure_run():
    _, breakers, hook, a = breaker_fixture()
    for verdict in ["timeout", "timeout", "ok", "timeout", "timeout"]:
        attempt(hook, a, verdict)
    assert breakers.state(a) is BreakerState.CLOSED
    assert not a.ejected


def test_no_verdict_is_neither_a_failure_nor_a_success():
    _, breakers, hook, a = breaker_fixture()
    attempt(hook, a, "mid_stream")
    attempt(hook, a, "mid_stream")
    for _ in range(5):
        attempt(hook, a, None)  # clients leaving do not eject a replica …
    assert breakers.state(a) is BreakerState.CLOSED
    attempt(hook, a, "mid_stream")  # … nor wipe its failure run
    assert breakers.state(a) is BreakerState.OPEN


def _half_open(breakers, hook, a):
    for _ in range(3):
        attempt(hook, a, "http_500")
    breakers.review(now=time.monotonic() + 5)
    assert breakers.state(a) is BreakerState.HALF_OPEN
    assert not a.ejected


def test_probe_without_verdict_lets_another_request_probe():
    _, breakers, hook, a = breaker_fixture()
    _half_open(breakers, hook, a)
    req = request()
    hook.on_send(req, a)
    assert a.ejected  # the probe is out: nobody else is sent meanwhile
    hook.on_done(req, a, Outcome(False, None))  # release_probe
    assert breakers.state(a) is BreakerState.HALF_OPEN
    assert not a.ejected
    attempt(hook, a, "ok")  # the next probe succeeds
    assert breakers.state(a) is BreakerState.CLOSED
    assert not a.ejected


def test_failed_probe_opens_the_breaker_again():
    svc, breakers, hook, a = breaker_fixture()
    _half_open(breakers, hook, a)
    attempt(hook, a, "http_502")
    assert breakers.state(a) is BreakerState.OPEN
    assert a.ejected
    assert sample(svc, "llm_gateway_endpoint_ejections_total", endpoint=a.name, reason="probe_http_502") == 1


# -- PassiveHealthHook ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("verdict", "marked"),
    [
        ("connect", True),
        ("timeout", False),
        ("http_503", False),
        ("mid_stream", False),
        ("ok", False),
        (None, False),
    ],
)
def test_passive_health_marks_only_refused_connections(verdict, marked):
    svc = services()
    a, b = endpoint(1), endpoint(2)
    registry = EndpointRegistry([a, b])
    tracker = HealthTracker(registry, HealthConfig(unhealthy_threshold=1), svc.metrics)
    hook = PassiveHealthHook(tracker.mark_failed)
    hook.on_done(request(), a, Outcome(verdict == "ok", verdict))
    assert a.healthy is (not marked)
    assert (a in registry.candidates("m")) is (not marked)
    assert b.healthy


# -- through a real gateway -------------------------------------------------------------------


def _row(gw, url):
    e = gw.state.registry.get(url)
    return e.in_flight, e.in_flight_tokens, e.pending_prefill_tokens


async def test_client_disconnect_mid_stream_returns_counters_to_zero(start_sim, start_gateway, http):
    sim = await start_sim(model="sim-llama", time_scale=1.0)  # ~6 ms per token: a long stream
    gw = await start_gateway([sim.url])  # default policy prefix-aware: the prefix hook is on
    body = chat_body("sim-llama", stream=True, max_tokens=2000)
    body["messages"] = [{"role": "user", "content": "tell me a long story " * 20}]
    resp = await http.post(gw.url + "/v1/chat/completions", json=body)
    assert resp.status == 200
    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    assert first.startswith(b"data: ")
    e = gw.state.registry.get(sim.url)
    assert e.in_flight == 1
    assert e.in_flight_tokens > 0
    assert gw.state.prefix.size(e) > 0  # the prompt was recorded on send
    resp.close()  # the client goes away mid-stream

    async def idle() -> bool:
        return _row(gw, sim.url) == (0, 0, 0.0)

    await wait_until(idle, 3.0, "in-flight and pending prefill to return to 0")


async def test_client_disconnect_before_the_first_byte_releases_pending_prefill(
    start_upstream, start_gateway, http
):
    up = await start_upstream()
    up.mode = "hold"  # non-streaming: never sends a byte
    gw = await start_gateway([up.url])
    body = chat_body()
    body["messages"] = [{"role": "user", "content": "a prompt of several prefix blocks " * 10}]
    task = asyncio.create_task(http.post(gw.url + "/v1/chat/completions", json=body))

    async def waiting() -> bool:
        return _row(gw, up.url)[0] == 1

    await wait_until(waiting, 3.0, "the request to reach the upstream")
    _, tokens, pending = _row(gw, up.url)
    assert tokens > 0
    assert pending > 0  # sent, no first byte yet
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(up.cancelled.wait(), 2.0)

    async def idle() -> bool:
        return _row(gw, up.url) == (0, 0, 0.0)

    await wait_until(idle, 3.0, "in-flight and pending prefill to return to 0")
