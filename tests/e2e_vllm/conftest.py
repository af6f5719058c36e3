"""Real vLLM (CPU build) replicas behind the gateway: opt-in, slow, and never silently skipped.

Off by default: without ``LLMGW_E2E_VLLM=1`` every test here is skipped, so the fast
suite never pays for two vLLM engines. With it set, nothing is skipped: a missing
venv is installed (``loadtest/realvllm/install.sh``), the model is built, and any
failure along the way fails the tests.

One fleet for the whole session (two replicas start in ~55 s with a warm compile
cache, ~90 s cold, ~1.9 GB RSS each). Its KV cache is deliberately small —
``NUM_BLOCKS`` blocks of 32 tokens per replica — so prefix caching is under pressure.
A test that stops a replica leaves it stopped; the next test that asks for the fleet
gets it restarted first.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.realvllm.fleet import Replica, ReplicaOptions, restart_replica, start_replicas, stop_replicas

ENABLED = os.environ.get("LLMGW_E2E_VLLM") == "1"
HERE = Path(__file__).resolve().parent
NUM_BLOCKS = 128
BLOCK_SIZE = 32
# KV events on (ZMQ, two ports per replica): the exact prefix index follows the real engines.
OPTIONS = ReplicaOptions(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, kv_events=True)
# Per test, including the first one's share of the fleet start-up (and a first-time install).
TIMEOUT_S = 480
START_TIMEOUT_S = 420  # two compiling engines on two shared cores can take minutes


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE in item.path.resolve().parents]
    for item in mine:
        if ENABLED:
            item.add_marker(pytest.mark.timeout(TIMEOUT_S))
        else:
            item.add_marker(pytest.mark.skip(reason="real vLLM e2e tests: set LLMGW_E2E_VLLM=1"))


class Fleet:
    """The session's replicas; ``ready()`` restarts any that a test stopped."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def ready(self) -> Fleet:
        for i, replica in enumerate(self.replicas):
            if not replica.alive() or replica.terminated:
                self.replicas[i] = restart_replica(replica)
        return self


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if not ENABLED:  # belt and braces: the hook above already skipped the tests
        pytest.fail("LLMGW_E2E_VLLM=1 is not set")
    logs = tmp_path_factory.mktemp("vllm-logs")
    fleet = Fleet(start_replicas(2, OPTIONS, log_dir=logs, timeout_s=START_TIMEOUT_S))
    for r in fleet.replicas:
        print(f"\n{r.name} {r.url} ready in {r.ready_s:.1f}s, RSS {r.rss_bytes() / 2**30:.2f} GiB")
    try:
        yield fleet
    finally:
        stop_replicas(fleet.replicas)


@pytest.fixture
def fleet(vllm_fleet: Fleet) -> Fleet:
    """The running fleet (restarting any replica an earlier test stopped)."""
    return vllm_fleet.ready()
