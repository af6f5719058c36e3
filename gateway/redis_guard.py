"""The one fallback policy for everything the gateway keeps in Redis (prefix index, sessions).

Redis is an optimisation shared by gateway instances, never a dependency of a request:

- every call gets a time budget; a slow or failed call is answered from the local copy;
- after a failure Redis is skipped for ``retry_after_s`` (no request pays the timeout
  while it is down), then tried again — redis-py reconnects on its own;
- the outage is logged once when it starts and once when it ends, and every fallback is
  counted by reason;
- writes run in the background, bounded in number, off the request's critical path;
- a data error on one key (``WRONGTYPE``: a string where a hash belongs) fails that call
  alone: Redis is up, and one corrupt key must not send every other key to the local copy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from redis.exceptions import ReadOnlyError, RedisError, ResponseError

__all__ = ["RedisGuard"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_DATA_ERROR_LOG_INTERVAL_S = 10.0


class RedisGuard:
    def __init__(
        self,
        what: str,
        *,
        budget_s: float,
        retry_after_s: float = 1.0,
        max_pending_writes: int = 1024,
        on_fallback: Callable[[str], None] | None = None,
    ) -> None:
        self._what = what
        self.budget_s = budget_s
        self._retry_after_s = retry_after_s
        self._max_pending = max_pending_writes
        self._on_fallback = on_fallback if on_fallback is not None else (lambda reason: None)
        self._skip_until = 0.0
        self._down = False
        self._pending: set[asyncio.Task[None]] = set()
        self._data_error_logged_at = -_DATA_ERROR_LOG_INTERVAL_S

    def available(self) -> bool:
        return time.monotonic() >= self._skip_until

    def fallback(self, reason: str) -> None:
        self._on_fallback(reason)

    def failed(self, reason: str, exc: BaseException | None) -> None:
        self._skip_until = time.monotonic() + self._retry_after_s
        self._on_fallback(reason)
        if not self._down:
            self._down = True
            log.warning("%s: Redis %s (%s); using the local copy until it is back", self._what, reason, exc)

    def succeeded(self) -> None:
        if self._down:
            self._down = False
            log.warning("%s: Redis is back", self._what)

    async def call(self, operation: Awaitable[T], budget_s: float | None = None) -> T | None:
        """Run one Redis operation within the budget; None (and a counted fallback) if it failed."""
        if not self.available():
            self._on_fallback("skipped")
            if asyncio.iscoroutine(operation):
                operation.close()
            return None
        try:
            async with asyncio.timeout(self.budget_s if budget_s is None else budget_s):
                result = await operation
        except TimeoutError as exc:
            self.failed("timeout", exc)
            return None
        except ResponseError as exc:
            if isinstance(exc, ReadOnlyError):  # a replica promoted away from us: an outage
                self.failed("error", exc)
                return None
            self._on_fallback("data_error")
            now = time.monotonic()
            if now - self._data_error_logged_at >= _DATA_ERROR_LOG_INTERVAL_S:
                self._data_error_logged_at = now
                log.warning("%s: Redis refused one call (%s); that call uses the local copy", self._what, exc)
            return None
        except (RedisError, OSError) as exc:
            self.failed("error", exc)
            return None
        self.succeeded()
        return result

    def spawn(self, write: Coroutine[Any, Any, Any]) -> None:
        """Run a write in the background (budget × 20, at least 100 ms); dropped when too many wait."""
        if not self.available() or len(self._pending) >= self._max_pending:
            write.close()
            if self.available():
                self._on_fallback("write_dropped")
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (configuration time): nothing to run it on
            write.close()
            return
        task = loop.create_task(self._write(write))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write(self, write: Coroutine[Any, Any, Any]) -> None:
        await self.call(write, budget_s=max(0.1, self.budget_s * 20))

    async def flush(self) -> None:
        """Wait for background writes (tests, shutdown)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
