"""supervise(): a background task that crashes is logged, reported and restarted; cancel ends it."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.ops.tasks import supervise


async def test_a_crashing_task_is_restarted_with_backoff_and_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs: list[int] = []
    crashes: list[str] = []

    async def flaky() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise RuntimeError(f"boom {len(runs)}")
        await asyncio.Event().wait()  # the third run stays up

    with caplog.at_level(logging.ERROR, logger="gateway.ops.tasks"):
        task = asyncio.create_task(supervise("flaky", flaky, on_crash=crashes.append, first_backoff_s=0.01))
        for _ in range(200):
            if len(runs) == 3:
                break
            await asyncio.sleep(0.01)
        assert len(runs) == 3
        assert crashes == ["flaky", "flaky"]
        assert sum("background task flaky crashed" in r.getMessage() for r in caplog.records) == 2
        assert all(r.exc_info for r in caplog.records if "crashed" in r.getMessage())  # with tracebacks
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_task_that_returns_is_started_again() -> None:
    runs = 0

    async def quits() -> None:
        nonlocal runs
        runs += 1

    task = asyncio.create_task(supervise("quits", quits, first_backoff_s=0.01, max_backoff_s=0.01))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert runs >= 3
