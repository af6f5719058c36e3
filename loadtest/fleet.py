"""Start and stop the processes a benchmark needs: simulated replicas and gateways.

Each replica and each gateway is its own OS process (its own event loop), as in a
real deployment; the load generator runs in the caller's process. Everything binds
127.0.0.1, and every process is ended by the PID this module started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

__all__ = ["ManagedProcess", "free_ports", "start_gateway", "start_replicas", "stop_all"]


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (held open together so they cannot repeat)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class ManagedProcess:
    name: str
    url: str
    process: asyncio.subprocess.Process
    log_path: Path
    extra: dict[str, str] = field(default_factory=dict)

    def log_tail(self, max_chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-max_chars:]
        return ""

    async def stop(self, grace_s: float = 5.0) -> None:
        if self.process.returncode is not None:
            return
        self.process.terminate()
        try:
            await asyncio.wait_for(self.process.wait(), grace_s)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


async def _spawn(name: str, url: str, argv: Sequence[str], log_dir: Path) -> ManagedProcess:
    log_path = log_dir / f"{name}.log"
    log_file = log_path.open("wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=log_file, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL, env=env
    )
    log_file.close()
    return ManagedProcess(name, url, process, log_path)


async def _wait_ready(proc: ManagedProcess, path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session:
        while time.monotonic() < deadline:
            if proc.process.returncode is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.process.returncode}:\n{proc.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(proc.url + path) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{proc.name} not ready after {timeout_s}s:\n{proc.log_tail()}")


def _log_dir(log_dir: Path | None) -> Path:
    path = log_dir or Path(tempfile.mkdtemp(prefix="llm-gateway-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


async def start_replicas(
    count: int, sim_args: Sequence[str] = (), *, log_dir: Path | None = None, timeout_s: float = 30
) -> list[ManagedProcess]:
    """``count`` simulator processes (``python -m loadtest.simulator``), ready to serve."""
    directory = _log_dir(log_dir)
    procs = []
    for index, port in enumerate(free_ports(count)):
        argv = [sys.executable, "-m", "loadtest.simulator", "--port", str(port), "--seed", str(index)]
        procs.append(
            await _spawn(f"replica-{index}", f"http://127.0.0.1:{port}", [*argv, *sim_args], directory)
        )
    try:
        await asyncio.gather(*(_wait_ready(p, "/health", timeout_s) for p in procs))
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
    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
    for url in endpoints:
        argv += ["--endpoint", url]
    proc = await _spawn(name, f"http://127.0.0.1:{port}", [*argv, *gateway_args], _log_dir(log_dir))
    try:
        await _wait_ready(proc, "/ready", timeout_s)
    except BaseException:
        await proc.stop()
        raise
    return proc


async def stop_all(procs: Sequence[ManagedProcess]) -> None:
    await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
