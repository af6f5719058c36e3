"""The processes most benchmarks need: simulated replicas and ``llm-gateway serve``.

Each replica and each gateway is its own OS process (its own event loop), as in a real
deployment; the load generator runs in the caller's process. Everything binds 127.0.0.1,
and every process is ended by the PID that :mod:`loadtest.harness.processes` started.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from loadtest.harness.ports import free_port, free_ports
from loadtest.harness.processes import ManagedProcess, log_dir, spawn, stop_all, wait_ready

__all__ = ["ManagedProcess", "free_ports", "start_gateway", "start_replicas", "stop_all"]


async def start_replicas(
    count: int, sim_args: Sequence[str] = (), *, log_dir: Path | None = None, timeout_s: float = 30
) -> list[ManagedProcess]:
    """``count`` simulator processes (``python -m loadtest.simulator``), ready to serve."""
    directory = _log_dir(log_dir)
    procs = []
    for index, port in enumerate(free_ports(count)):
        argv = [sys.executable, "-m", "loadtest.simulator", "--port", str(port), "--seed", str(index)]
        url = f"http://127.0.0.1:{port}"
        procs.append(await spawn(f"replica-{index}", url, [*argv, *sim_args], directory))
    try:
        await asyncio.gather(*(wait_ready(p, "/health", timeout_s) for p in procs))
    except BaseException:
        await stop_all(procs)
        raise
    return procs


async def start_gateway(
    endpoints: Sequence[str],
    gateway_args: Sequence[str] = (),
    *,
    name: str = "gateway",
    log_dir: Path | None = None,
    timeout_s: float = 30,
) -> ManagedProcess:
    """A ``llm-gateway serve`` process in front of ``endpoints``, ready (``/ready`` is 200)."""
    port = free_port()
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
    for url in endpoints:
        argv += ["--endpoint", url]
    proc = await spawn(name, f"http://127.0.0.1:{port}", [*argv, *gateway_args], _log_dir(log_dir))
    try:
        await wait_ready(proc, "/ready", timeout_s)
    except BaseException:
        await proc.stop()
        raise
    return proc


_log_dir = log_dir
