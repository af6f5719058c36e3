"""Exact state off the critical path: replayed (old) batches do not make a stream stale, and
with ``reuse_turn_tokens`` a conversation's next turn is matched on the previous turn's
tokens without waiting for ``/tokenize`` (fetched in the background, and checked)."""

from __future__ import annotations

import asyncio

from gateway.prefix.turn_tokens import TurnTokens
from tests.prefix.conftest import gateway_config
from tests.prefix.test_exact_prefix_e2e import EXACT, ask, exact_of, metrics, name_of, settle, wait_live
from tests.support.harness import metric_value


async def test_a_gateway_started_long_after_the_events_is_live_at_once(
    start_sims, start_gateway, http
) -> None:
    (sim,) = await start_sims(1, kv_events=True, kv_blocks=256)
    first = await start_gateway(gateway_config([sim.url], prefix=EXACT))
    await wait_live(first, [sim])
    messages = [{"role": "user", "content": "the old stone bridge over the river " * 8}]
    await ask(http, first, messages)
    await settle(first, [sim])
    await first.stop()
    await asyncio.sleep(2.5)  # past stale_after_s: the replay buffer only holds old batches
    second = await start_gateway(gateway_config([sim.url], prefix=EXACT))
    await wait_live(second, [sim])  # from the replay alone, with no new event published
    await settle(second, [sim])
    _, predicted, cached, _ = await ask(http, second, messages)
    assert predicted == cached > 0


async def test_next_turns_skip_the_tokenize_wait_once_the_template_is_trusted(
    start_sims, start_gateway, http
) -> None:
    sims = await start_sims(2, kv_events=True, kv_blocks=256)
    prefix = {"exact": "auto", "kv_events": {**EXACT["kv_events"], "reuse_turn_tokens": True}}
    gw = await start_gateway(gateway_config([s.url for s in sims], prefix=prefix))
    await wait_live(gw, sims)
    conversation = [{"role": "system", "content": "You survey bridges. " + "arch pier span " * 30}]
    for turn in range(8):
        conversation.append({"role": "user", "content": f"turn {turn}: " + "what about the keystone " * 3})
        await settle(gw, sims)
        _, predicted, cached, text = await ask(http, gw, conversation)
        assert predicted <= cached  # a prefix of the turn's tokens never over-predicts
        conversation.append({"role": "assistant", "content": text})
    text = await metrics(http, gw)
    reused = metric_value(text, "llm_gateway_prefix_tokenize_total", outcome="previous_turn")
    assert reused is not None and reused >= 8 - 1 - 3  # after 3 confirmations, every next turn
    assert not metric_value(text, "llm_gateway_prefix_tokenize_total", outcome="previous_turn_mismatch")
    assert all(exact_of(gw).index.live(name_of(s)) for s in sims)


def test_a_template_that_rewrites_history_is_never_trusted() -> None:
    turns = TurnTokens(16)
    for _ in range(3):
        assert turns.verify("m", [1, 2, 3], [1, 2, 3, 4])
    assert turns.trusted("m")
    assert not turns.verify("m", [1, 2, 3], [1, 9, 3, 4])  # reported once
    assert not turns.trusted("m")
    assert turns.verify("m", [1], [1, 2]) and not turns.trusted("m")  # and never trusted again
