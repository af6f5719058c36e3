"""Data-parallel rank targets (gateway/fleet/dp.py): ranks from real vLLM 0.32 scrapes, rank
state kept across rank-set changes, per-rank KV-event sources, hostile labels.

``tests/data/vllm-0.32-cpu-dp2-metrics-sample.txt`` is the ``/metrics`` page of one CPU vLLM
0.32 with ``--data-parallel-size 2`` after one request: its gauges carry ``engine="0"`` only,
its counters and ``cache_config_info`` both ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

from gateway.fleet.dp import engine_ranks, rank_out_of_range, set_ranks, update_rank_loads
from gateway.fleet.endpoint import Endpoint, EngineKind
from gateway.fleet.kv_sources import source_from
from gateway.fleet.registry import EndpointRegistry
from gateway.fleet.scraper import ScrapedPage, parse_page

DATA = Path(__file__).resolve().parents[1] / "data"
DP2 = parse_page((DATA / "vllm-0.32-cpu-dp2-metrics-sample.txt").read_text(), EngineKind.VLLM)
SINGLE = parse_page((DATA / "vllm-0.32-cpu-metrics-sample.txt").read_text(), EngineKind.VLLM)


def test_ranks_from_real_scrapes() -> None:
    assert engine_ranks(DP2) == [0, 1]
    assert engine_ranks(SINGLE) == [0]  # vLLM without DP labels engine="0": no targets


def test_a_rank_without_gauges_is_not_reported_and_keeps_its_cache_config() -> None:
    replica = Endpoint("http://127.0.0.1:8000", healthy=True)
    changed, dropped = update_rank_loads(replica, DP2)
    assert changed and dropped == []
    rank0, rank1 = replica.rank_targets
    assert (rank0.name, rank1.name) == ("127.0.0.1:8000#dp0", "127.0.0.1:8000#dp1")
    assert rank0.metrics.running == 0 and rank0.metrics.kv_usage == 0
    assert rank1.metrics.running is None and rank1.metrics.waiting is None  # vLLM exports none
    assert rank1.metrics.block_size == 32 and rank1.metrics.fresh()
    assert update_rank_loads(Endpoint("http://h:1"), SINGLE) == (False, [])


def test_hostile_engine_labels_are_no_ranks() -> None:
    page = "\n".join(
        f'vllm:num_requests_running{{engine="{label}",model_name="m"}} 1.0'
        for label in ("0", "1", "x", "-1", "99999999", "")
    )
    assert engine_ranks(parse_page(page, EngineKind.VLLM)) == [0, 1]


def test_ranks_are_the_run_from_zero_with_canonical_labels() -> None:
    """A rank set is 0..N-1 as vLLM numbers it: what lies past a gap, and padded labels
    (another name for a rank already there), are not routed to."""

    def page(*labels: str) -> ScrapedPage:
        text = "\n".join(f'vllm:num_requests_running{{engine="{x}",model_name="m"}} 0' for x in labels)
        return parse_page(text, EngineKind.VLLM)

    assert engine_ranks(page("0", "1", "1023")) == [0, 1]
    assert engine_ranks(page("0", "01", "1")) == [0, 1]  # "01" is no third rank
    assert engine_ranks(page("00", "01")) == []  # nor do padded labels make ranks
    assert engine_ranks(page("2", "3")) == []  # ranks 2 and 3 of a multi-node deployment: one target
    assert engine_ranks(page(*(str(r) for r in range(1100)))) == list(range(1024))


def test_rank_set_changes_keep_the_state_of_ranks_that_stay() -> None:
    replica = Endpoint("http://127.0.0.1:8000", healthy=True)
    set_ranks(replica, [0, 1])
    kept = replica.rank_targets[1]
    kept.in_flight = 3
    dropped = set_ranks(replica, [0, 1, 2])
    assert dropped == [] and replica.rank_targets[1] is kept
    dropped = set_ranks(replica, [0])  # one rank: the replica routes as itself again
    assert replica.rank_targets == () and {t.dp_rank for t in dropped} == {0, 1, 2}


def test_registry_routes_ranks_with_the_replicas_health() -> None:
    replica = Endpoint("http://127.0.0.1:8000", configured_models=frozenset({"m"}), healthy=True)
    registry = EndpointRegistry([replica])
    set_ranks(replica, [0, 1])
    registry.rebuild()
    assert [t.name for t in registry.candidates("m")] == ["127.0.0.1:8000#dp0", "127.0.0.1:8000#dp1"]
    assert all(t in registry and t.owner is replica for t in replica.rank_targets)
    replica.draining = True
    registry.rebuild()
    assert registry.candidates("m") == [] and all(t.draining for t in replica.rank_targets)
    replica.draining = False
    replica.healthy = False  # down: it may come back with another --data-parallel-size
    registry.rebuild()
    assert replica.rank_targets == () and registry.candidates("m") == []
    configured = Endpoint("http://127.0.0.1:8001", configured_models=frozenset({"m"}), data_parallel_size=2)
    registry.add(configured)
    assert [t.dp_rank for t in configured.rank_targets] == [0, 1]  # routed as ranks from the start


def test_each_rank_follows_its_own_event_source() -> None:
    sources = {
        "0": {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:6557"},
        "1": {"publisher": "zmq", "endpoint": "tcp://*:5558", "replay_endpoint": "tcp://*:6558"},
    }
    one = source_from(sources, "10.0.0.5", 1)
    assert one is not None and (one.endpoint, one.replay_endpoint) == (
        "tcp://10.0.0.5:5558",
        "tcp://10.0.0.5:6558",
    )
    assert source_from(sources, "10.0.0.5", 2) is None  # a rank the server does not list
    first = source_from(sources, "10.0.0.5")
    assert first is not None and first.endpoint == "tcp://10.0.0.5:5557"
    # One config for every rank (an endpoint's kv_events override): vLLM offsets the ports by the rank.
    single = {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://127.0.0.1:6557"}
    offset = source_from(single, "h", 3)
    assert offset is not None and (offset.endpoint, offset.replay_endpoint) == (
        "tcp://h:5560",
        "tcp://127.0.0.1:6560",
    )


def _error(message: str) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    ).encode()


def test_only_vllms_own_refusal_of_the_rank_sent_is_a_refusal() -> None:
    """Other 400s quote the client's input back: a client must not be able to word a refusal
    (each one drops the server's learned ranks and sends its request twice)."""
    assert rank_out_of_range(_error("data_parallel_rank 3 is out of range [0, 2)."), 3)
    assert rank_out_of_range(
        json.dumps({"object": "error", "message": "data_parallel_rank 1 is out of range [0, 1)."}).encode(), 1
    )
    assert not rank_out_of_range(
        _error("data_parallel_rank 3 is out of range [0, 2)."), 2
    )  # not the rank sent
    assert not rank_out_of_range(
        _error("data_parallel_rank 1 is out of range [0, 4)."), 1
    )  # 1 < 4: no refusal
    echoed = (
        "1 validation error: min_tokens: Input should be a valid integer "
        "[input_value='data_parallel_rank 3 is out of range [0, 2).']"
    )
    assert not rank_out_of_range(_error(echoed), 3)
    assert not rank_out_of_range(b"data_parallel_rank 3 is out of range [0, 2).", 3)  # not vLLM's envelope
    assert not rank_out_of_range(_error("data_parallel_rank 3 is out of range [0, 2)." + " " * 5000), 3)


def test_a_label_of_thousands_of_digits_is_no_rank() -> None:
    page = 'vllm:num_requests_running{engine="0",model_name="m"} 0\n'
    page += f'vllm:num_requests_running{{engine="{"1" * 5000}",model_name="m"}} 0\n'
    assert engine_ranks(parse_page(page, EngineKind.VLLM)) == [0]  # one target; no int() of 5,000 digits
