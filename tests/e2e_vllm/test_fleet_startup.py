"""The real-vLLM harness survives a replica that dies while starting (what failed CI once).

A KV-event port taken by another socket between the harness choosing it and the engine
binding it kills vLLM's engine core in start-up ("Engine core initialization failed").
The harness must then show the root cause and start that replica again on fresh ports.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from loadtest.harness.ports import free_ports
from loadtest.realvllm.fleet import ReplicaOptions, start_replica, wait_ready_retrying

from .conftest import BLOCK_SIZE, NUM_BLOCKS, START_TIMEOUT_S


def test_a_replica_whose_kv_port_is_taken_is_restarted_on_fresh_ports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port, pub, replay = free_ports(3)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("0.0.0.0", pub))
        squatter.listen()
        options = ReplicaOptions(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, kv_events=True)
        replicas = [start_replica(0, port, options, log_dir=tmp_path, kv_ports=(pub, replay))]
        try:
            wait_ready_retrying(replicas, START_TIMEOUT_S, tmp_path)
            printed = capsys.readouterr().out
            assert "exited while starting (attempt 1)" in printed
            assert "EngineCore failed to start" in printed and "Address already in use" in printed
            assert replicas[0].kv_ports is not None and replicas[0].kv_ports[0] != pub
            assert replicas[0].alive() and replicas[0].ready_s is not None
        finally:
            for replica in replicas:
                replica.stop()
