"""Real `llm-gateway serve --workers N` processes, for the tests of workers (tests/web/workers/)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from loadtest.harness.ports import free_port
from loadtest.harness.processes import ManagedProcess, spawn, wait_ready


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def worker_pids(parent: int) -> set[int]:
    """The gateway parent's worker processes (not multiprocessing's resource tracker, also its child)."""
    found = set()
    for pid in children(parent):
        with contextlib.suppress(OSError):
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(pid)
    return found


def handles_signal(pid: int, signum: int) -> bool:
    """Whether ``pid`` has a handler installed for ``signum`` (SigCgt in /proc/pid/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signum - 1)))
    return False


async def spawn_gateway(
    endpoints: list[str],
    args: list[str],
    log_dir: Path,
    *,
    port: int | None = None,
    new_session: bool = False,
    ready: bool = True,
    name: str = "gateway",
) -> ManagedProcess:
    port = port or free_port()
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
    for url in endpoints:
        argv += ["--endpoint", url]
    proc = await spawn(name, f"http://127.0.0.1:{port}", [*argv, *args], log_dir, new_session=new_session)
    if ready:
        try:
            await wait_ready(proc, "/ready", 30)
        except BaseException:
            await proc.stop()
            raise
    return proc


async def spawn_admin_gateway(endpoint: str, admin_key: str, log_dir: Path) -> ManagedProcess:
    """``serve --workers 2`` in front of ``endpoint``, its admin API open to ``admin_key``."""
    config = log_dir / "gw.yaml"
    config.write_text(f"auth:\n  admin_key_sha256: {hashlib.sha256(admin_key.encode()).hexdigest()}\n")
    return await spawn_gateway([endpoint], ["--workers", "2", "--config", str(config)], log_dir)


@contextlib.asynccontextmanager
async def by_worker(
    gw_url: str, workers: int = 2, per_worker: int = 1
) -> AsyncIterator[dict[str, list[aiohttp.ClientSession]]]:
    """One-connection client sessions grouped by the worker pid that serves them."""
    found: dict[str, list[aiohttp.ClientSession]] = {}
    sessions: list[aiohttp.ClientSession] = []
    try:
        for _ in range(400):
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1), timeout=aiohttp.ClientTimeout(total=30)
            )
            sessions.append(session)
            async with session.get(gw_url + "/health") as resp:
                found.setdefault(resp.headers["x-gateway-worker"], []).append(session)
            if len(found) >= workers and all(len(v) >= per_worker for v in found.values()):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(f"connections never reached {workers} workers: {list(found)}")
        yield found
    finally:
        for session in sessions:
            await session.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def shared_directory(worker_pid: int) -> str:
    """The gateway's private directory, found from the worker's mapping of the load table."""
    for line in Path(f"/proc/{worker_pid}/maps").read_text().splitlines():
        if "llm-gateway-" in line and line.rstrip().endswith("/load"):
            return os.path.dirname(line.split()[-1])
    raise AssertionError("no shared table mapped")
