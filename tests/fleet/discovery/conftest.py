"""Fixtures for discovery sources: an ``apply`` that records every call, and a runner that checks
the source is still running (a source may only stop when cancelled) before cancelling it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from gateway.config import EndpointConfig
from gateway.fleet.discovery import DiscoverySource


class Recorder:
    """The ``apply`` callback: remembers every (source, endpoints) call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[EndpointConfig]]] = []

    def __call__(self, source: str, endpoints: list[EndpointConfig]) -> None:
        self.calls.append((source, list(endpoints)))

    @property
    def latest(self) -> list[EndpointConfig] | None:
        return self.calls[-1][1] if self.calls else None

    @property
    def urls(self) -> set[str] | None:
        latest = self.latest
        return None if latest is None else {e.url for e in latest}

    def by_url(self) -> dict[str, EndpointConfig]:
        return {e.url: e for e in self.latest or []}

    async def wait_for(
        self, check: Callable[[list[EndpointConfig]], bool], within_s: float = 3.0, what: str = "endpoints"
    ) -> list[EndpointConfig]:
        """Poll until the latest applied list satisfies ``check``; fail the test after ``within_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            latest = self.latest
            if latest is not None and check(latest):
                return latest
            if loop.time() >= deadline:
                raise AssertionError(
                    f"timed out after {within_s}s waiting for {what}; last applied: {latest}"
                )
            await asyncio.sleep(0.01)

    async def wait_urls(self, urls: set[str], within_s: float = 3.0) -> list[EndpointConfig]:
        return await self.wait_for(lambda eps: {e.url for e in eps} == urls, within_s, f"urls {sorted(urls)}")


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
async def run_source() -> AsyncIterator[Callable[[DiscoverySource, Recorder], asyncio.Task[None]]]:
    """``run_source(source, recorder)`` starts ``source.run(recorder)`` as a task, stopped at teardown."""
    tasks: list[asyncio.Task[None]] = []

    def start(source: DiscoverySource, apply: Recorder) -> asyncio.Task[None]:
        task = asyncio.create_task(source.run(apply))
        tasks.append(task)
        return task

    yield start
    for task in tasks:
        if task.done() and not task.cancelled():  # run() returned or raised: that breaks the contract
            task.result()
            raise AssertionError(f"{task} ended without being cancelled")
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
