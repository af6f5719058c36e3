"""One process manager: start with a log file, wait for HTTP readiness, stop by PID.

Every process is ended by the PID this module started: SIGTERM, then SIGKILL after a
grace period. A process started with ``new_session=True`` leads its own process group;
with ``kill_group=True`` its stop also SIGKILLs that group, so children that outlive
their parent (SO_REUSEPORT workers) go with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

__all__ = ["ManagedProcess", "ReadyCheck", "log_dir", "spawn", "stop_all", "wait_ready"]

#: ``check(response) -> ready?``, for readiness that needs more than a 200 (a body to read).
ReadyCheck = Callable[[aiohttp.ClientResponse], Awaitable[bool]]


@dataclass
class ManagedProcess:
    name: str
    url: str
    process: asyncio.subprocess.Process
    log_path: Path
    extra: dict[str, str] = field(default_factory=dict)
    kill_group: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def log_tail(self, max_chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-max_chars:].decode(errors="replace")
        return ""

    async def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM, SIGKILL after ``grace_s``; returns the exit code."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    if self.kill_group:
                        os.killpg(self.pid, signal.SIGKILL)  # its own session: the pid is the pgid
                    else:
                        self.process.kill()
                await self.process.wait()
        if self.kill_group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        return self.process.returncode

    async def kill(self) -> None:
        """SIGKILL by PID, at once (a crash, for fault runs)."""
        if self.process.returncode is None:
            os.kill(self.pid, signal.SIGKILL)
            await self.process.wait()


def log_dir(path: Path | None, prefix: str = "llm-gateway-") -> Path:
    """``path`` (created), or a fresh temporary directory."""
    directory = path or Path(tempfile.mkdtemp(prefix=prefix))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


async def spawn(
    name: str,
    url: str,
    argv: Sequence[str],
    directory: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    new_session: bool = False,
    kill_group: bool = False,
    log_path: Path | None = None,
) -> ManagedProcess:
    """Start ``argv`` with stdout and stderr in ``directory/name.log`` (or ``log_path``)."""
    path = log_path or directory / f"{name}.log"
    with path.open("wb") as log_file:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
            env=env or {**os.environ, "PYTHONUNBUFFERED": "1"},
            cwd=cwd,
            start_new_session=new_session or kill_group,
        )
    return ManagedProcess(name, url, process, path, kill_group=kill_group)


async def _probe(session: aiohttp.ClientSession, url: str, check: ReadyCheck | None) -> int:
    """The probe's status (0: no answer, or ``check`` said not yet)."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
        async with session.get(url) as resp:
            if resp.status == 200 and check is not None and not await check(resp):
                return 0
            return resp.status
    return 0


async def wait_ready(
    proc: ManagedProcess,
    path: str,
    timeout_s: float = 30.0,
    *,
    streak: int = 1,
    check: ReadyCheck | None = None,
    fresh_connections: bool = False,
    probe_timeout_s: float = 1.0,
    error: type[Exception] = RuntimeError,
) -> None:
    """Poll ``path`` until it answers 200 (and ``check`` agrees) ``streak`` times in a row.

    ``fresh_connections``: a new connection per probe, so that every worker process behind
    one SO_REUSEPORT port gets to answer. Raises ``error`` (with the log's tail) if the
    process exits first or is not ready within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    ok = 0
    connector = aiohttp.TCPConnector(force_close=fresh_connections)
    timeout = aiohttp.ClientTimeout(total=probe_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        while time.monotonic() < deadline:
            if proc.process.returncode is not None:
                raise error(f"{proc.name} exited with {proc.process.returncode}:\n{proc.log_tail()}")
            status = await _probe(session, proc.url + path, check)
            ok = ok + 1 if status == 200 else 0
            if ok >= streak:
                return
            await asyncio.sleep(0.02 if status == 200 else 0.1)
    raise error(f"{proc.name} not ready at {path} after {timeout_s:g}s:\n{proc.log_tail()}")


async def stop_all(procs: Sequence[ManagedProcess], grace_s: float = 5.0) -> None:
    await asyncio.gather(*(p.stop(grace_s) for p in procs), return_exceptions=True)
