"""One private ``redis-server`` wrapper: started on a loopback port, killed by its own PID.

Used by the fault runs (asynchronously, while load runs: ``start_async``/``kill_async``)
and by the test suite's fixtures (synchronously: ``start``/``kill``). No persistence, so
a kill drops every key; a restart on the same port comes back empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from loadtest.harness.ports import free_port

__all__ = ["RedisServer"]


def _pong(port: int, timeout_s: float) -> bool:
    with contextlib.suppress(OSError):
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    return False


class RedisServer:
    """``RedisServer(port=None, log_dir=None)``; ``proc`` is the running ``redis-server``."""

    def __init__(
        self, port: int | None = None, log_dir: Path | None = None, extra_args: tuple[str, ...] = ()
    ) -> None:
        self.extra_args = extra_args  # e.g. ("--enable-debug-command", "yes") for DEBUG SLEEP
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _launch(self) -> subprocess.Popen[bytes]:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH")
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--protected-mode", "no", *self.extra_args]  # fmt: skip
        if self.log_dir is None:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return self.proc
        argv += ["--dir", str(self.log_dir)]
        with (self.log_dir / f"redis-{self.port}.log").open("ab") as log_file:
            self.proc = subprocess.Popen(
                argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        return self.proc

    def _failed(self, proc: subprocess.Popen[bytes]) -> str | None:
        if proc.poll() is not None:
            return f"redis-server on port {self.port} exited with {proc.returncode}"
        return None

    def start(self, timeout: float = 5.0) -> RedisServer:
        """Start and wait (blocking) until it answers PING."""
        proc = self._launch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if problem := self._failed(proc):
                raise RuntimeError(problem)
            if _pong(self.port, 0.2):
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within {timeout}s")

    async def start_async(self, timeout_s: float = 10.0) -> RedisServer:
        """Start and wait until it answers PING, without blocking the event loop."""
        proc = self._launch()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if problem := self._failed(proc):
                raise RuntimeError(problem)
            with contextlib.suppress(OSError, TimeoutError):
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.write(b"PING\r\n")
                reply = await asyncio.wait_for(reader.readline(), 1)
                writer.close()
                if reply.startswith(b"+PONG"):
                    return self
            await asyncio.sleep(0.05)
        await self.kill_async()
        raise RuntimeError(f"redis-server on port {self.port} not ready after {timeout_s}s")

    def kill(self) -> None:
        """SIGKILL by PID (a crash: nothing is saved)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)

    async def kill_async(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            await _reaped(proc, 5.0)

    async def stop_async(self, grace_s: float = 5.0) -> None:
        """SIGTERM, SIGKILL after ``grace_s``."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        if not await _reaped(proc, grace_s):
            await self.kill_async()
        self.proc = None


async def _reaped(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.01)
    return True
