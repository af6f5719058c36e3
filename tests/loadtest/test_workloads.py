"""Workload determinism and shape: these properties are what the benchmarks rely on."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from loadtest.workloads import WORKLOADS, MultiTurnWorkload, SharedPrefixWorkload, WorkItem, make_workload


def _dump(items: list[WorkItem]) -> str:
    return json.dumps([[i.kind, i.body, i.headers, i.session_id, i.group, i.priority] for i in items])


def _prompt_words(item: WorkItem) -> list[str]:
    if item.kind == "completion":
        return item.body["prompt"].split()
    return " ".join(m["content"] for m in item.body["messages"]).split()


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_requests_different_seed_differs(name: str) -> None:
    a = list(make_workload(name, seed=7, scale=0.05).items())
    b = list(make_workload(name, seed=7, scale=0.05).items())
    c = list(make_workload(name, seed=8, scale=0.05).items())
    assert _dump(a) == _dump(b)
    assert _dump(a) != _dump(c)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_bodies_are_streaming_openai_requests(name: str) -> None:
    wl = make_workload(name, model="m1", scale=0.05)
    items = list(wl.items())
    assert items and len(items) <= wl.total_requests
    for item in items[:20]:
        assert item.body["model"] == "m1"
        assert item.body["stream"] is True
        assert item.body["stream_options"] == {"include_usage": True}
        assert item.body["max_tokens"] >= 1
        assert ("messages" in item.body) == (item.kind == "chat")


def test_shared_prefix_groups_share_exact_system_prompt_and_interleave() -> None:
    wl = make_workload(
        "shared-prefix", num_groups=4, prompts_per_group=5, system_prompt_len=64, question_len=8, seed=3
    )
    items = list(wl.items())
    assert len(items) == 20 == wl.total_requests
    systems: dict[int, set[str]] = {}
    for item in items:
        assert item.group is not None
        systems.setdefault(item.group, set()).add(item.body["messages"][0]["content"])
    assert all(len(s) == 1 for s in systems.values())
    distinct = {next(iter(s)) for s in systems.values()}
    assert len(distinct) == 4
    assert all(len(s.split()) == 64 for s in distinct)
    questions = [i.body["messages"][1]["content"] for i in items]
    assert len(set(questions)) == 20
    groups = [i.group for i in items]
    assert groups != sorted(groups)  # interleaved, not group after group


def test_shared_prefix_completion_api_and_scale() -> None:
    wl = make_workload("shared-prefix", api="completion", scale=0.01, num_groups=2, prompts_per_group=2)
    items = list(wl.items())
    assert all(i.kind == "completion" and i.path == "/v1/completions" for i in items)
    assert isinstance(wl, SharedPrefixWorkload)
    for i in items:
        assert i.group is not None
        system = wl.system_prompt(i.group)
        assert len(system.split()) == round(2048 * 0.01)
        assert i.body["prompt"].startswith(system + "\n\n")
    assert items[0].body["max_tokens"] == round(256 * 0.01)


def test_multi_turn_next_turn_extends_messages_exactly() -> None:
    wl = make_workload("multi-turn", num_users=3, num_rounds=3, scale=0.02)
    assert isinstance(wl, MultiTurnWorkload)
    firsts = list(wl.items())
    assert len(firsts) == 3 and wl.total_requests == 9
    assert len({f.body["messages"][0]["content"] for f in firsts}) == 1  # shared system prompt
    assert len({f.session_id for f in firsts}) == 3
    for first in firsts:
        assert first.headers["x-session-id"] == first.session_id == first.body["user"]
        item = first
        chain = [item]
        while (nxt := wl.next_turn(item, f"answer to turn {item.turn}")) is not None:
            prev = item.body["messages"]
            assert nxt.body["messages"][: len(prev)] == prev
            assert nxt.body["messages"][len(prev)] == {
                "role": "assistant",
                "content": f"answer to turn {item.turn}",
            }
            assert nxt.body["messages"][-1]["role"] == "user"
            assert nxt.turn == item.turn + 1 and nxt.session_id == first.session_id
            item = nxt
            chain.append(item)
        assert [c.turn for c in chain] == [0, 1, 2]
    # next turns are a pure function of (item, answer): order of completion does not matter
    assert _dump([wl.next_turn(firsts[0], "x")]) == _dump([wl.next_turn(firsts[0], "x")])  # type: ignore[list-item]


def test_sharegpt_like_has_no_shared_prefix_and_plausible_lengths() -> None:
    wl = make_workload("sharegpt-like", num_requests=300, seed=1)
    items = list(wl.items())
    words = [_prompt_words(i) for i in items]
    longest = 0
    for i in range(len(words)):
        for j in range(i + 1, len(words)):
            k = 0
            while k < min(len(words[i]), len(words[j])) and words[i][k] == words[j][k]:
                k += 1
            longest = max(longest, k)
    assert longest <= 3
    mean_in = sum(len(w) for w in words) / len(words)
    mean_out = sum(i.body["max_tokens"] for i in items) / len(items)
    assert 150 < mean_in < 300
    assert 140 < mean_out < 280


def test_burst_priority_mix_matches_proportions() -> None:
    wl = make_workload("burst", num_requests=200, critical=1, standard=2, sheddable=1, scale=0.05)
    items = list(wl.items())
    counts = Counter(i.priority for i in items)
    assert counts == {"critical": 50, "standard": 100, "sheddable": 50}
    assert all(i.headers["x-priority"] == i.priority for i in items)
    head = [i.priority for i in items[:40]]
    assert len(set(head)) == 3  # shuffled, not blocks of one class
    assert make_workload("burst", capacity_rps=10, overload=4).default_rate == 40


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("nope", {}),
        ("shared-prefix", {"bogus": 1}),
        ("shared-prefix", {"num_groups": 0}),
        ("shared-prefix", {"scale": -1}),
        ("shared-prefix", {"api": "embeddings"}),
        ("multi-turn", {"api": "completion"}),
        ("burst", {"critical": 0, "standard": 0, "sheddable": 0}),
        ("burst", {"critical": -1}),
    ],
)
def test_make_workload_validates(name: str, params: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        make_workload(name, **params)
