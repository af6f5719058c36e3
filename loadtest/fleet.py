"""Kept for callers outside ``loadtest`` (tests/web): the fleet lives in :mod:`loadtest.harness.fleet`."""

from loadtest.harness.fleet import ManagedProcess, free_ports, start_gateway, start_replicas, stop_all

__all__ = ["ManagedProcess", "free_ports", "start_gateway", "start_replicas", "stop_all"]
