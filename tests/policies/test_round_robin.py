"""Picker ``round-robin``."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.config import ConfigError
from tests.policies.helpers import endpoint, make_plugin, request, scored


def test_cycles_in_url_order_whatever_the_input_order_and_scores():
    picker = make_plugin("round-robin")
    a, b, c = endpoint(1), endpoint(2), endpoint(3)
    inputs = [((c, 9.0), (a, 0.0), (b, 1.0)), ((b, 0.0), (c, 0.0), (a, 5.0))]
    rankings = [[s.endpoint for s in picker.pick(request(), scored(*inputs[i % 2]))] for i in range(6)]
    assert rankings == [[a, b, c], [b, c, a], [c, a, b]] * 2


def test_spreads_exactly_evenly():
    picker = make_plugin("round-robin")
    fleet = [endpoint(i) for i in range(1, 5)]
    firsts = Counter(
        picker.pick(request(), scored(*((e, 0.0) for e in fleet)))[0].endpoint for _ in range(40)
    )
    assert firsts == dict.fromkeys(fleet, 10)


def test_instances_keep_separate_counters():
    one, two = make_plugin("round-robin"), make_plugin("round-robin")
    a, b = endpoint(1), endpoint(2)
    assert one.pick(request(), scored((a, 0), (b, 0)))[0].endpoint is a
    assert one.pick(request(), scored((a, 0), (b, 0)))[0].endpoint is b
    assert two.pick(request(), scored((a, 0), (b, 0)))[0].endpoint is a


def test_rejects_parameters():
    with pytest.raises(ConfigError, match=r"plugins\.0\.parameters\.start"):
        make_plugin("round-robin", {"start": 1})


def test_each_candidate_set_has_its_own_cycle():
    """Two models' requests interleaved (an embed-then-chat pipeline): one shared counter sent
    every chat request to the same one of its two replicas (review finding)."""
    picker = make_plugin("round-robin")
    chat, embed = (endpoint(1), endpoint(2)), (endpoint(3), endpoint(4))
    firsts = Counter()
    for _ in range(20):
        for pool in (embed, chat):
            firsts[picker.pick(request(), scored(*((e, 0.0) for e in pool)))[0].endpoint] += 1
    assert firsts == dict.fromkeys((*chat, *embed), 10)  # old: chat 20/0, embed 0/20


def test_two_models_on_one_pool_each_have_their_own_cycle():
    """Two models (or adapters) served by the same two replicas, called alternately: one cycle
    per candidate set still sent each model to one replica (re-review finding)."""
    picker = make_plugin("round-robin")
    pool = (endpoint(1), endpoint(2))
    firsts = Counter()
    for _ in range(20):
        for model in ("embed", "chat"):
            first = picker.pick(request(model=model), scored(*((e, 0.0) for e in pool)))[0].endpoint
            firsts[model, first] += 1
    assert firsts == {(m, e): 10 for m in ("embed", "chat") for e in pool}  # old: 20/0 and 0/20
