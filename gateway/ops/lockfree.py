"""prometheus_client's Counter and Histogram without a lock per update (issue 17).

prometheus_client keeps every sample in a ``MutexValue``: a ``threading.Lock`` taken on
each ``inc``, so a histogram observation costs two lock round trips and a Python loop over
the buckets. The gateway updates its metrics from the event loop's thread only (the
threads it starts hash prompts; they touch no metric), so the lock buys nothing there.

These subclasses keep prometheus_client's metric objects, their ``labels()`` /
``remove()`` / ``collect()`` and therefore the exposition byte for byte; only the values
are plain floats, added to in O(1) (a histogram finds its bucket by bisection) and read
when the registry is scraped. Exemplars, negative counter increments and the
multiprocess mode keep prometheus_client's own code path.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client import values as _values

__all__ = ["LockFreeCounter", "LockFreeHistogram"]


class _Value:
    """The float a ``MutexValue`` holds, without the mutex (same interface)."""

    __slots__ = ("_exemplar", "_value")

    def __init__(self) -> None:
        self._value = 0.0
        self._exemplar: Any = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def get(self) -> float:
        return self._value

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get_exemplar(self) -> Any:
        return self._exemplar


def _local() -> bool:
    """Plain floats only where prometheus_client itself would use in-process values."""
    return _values.ValueClass is _values.MutexValue


class LockFreeCounter(Counter):
    _fast = False  # set on observable instances (a labelled parent is not one)

    def _metric_init(self) -> None:
        super()._metric_init()
        if _local():
            self._value = _Value()  # type: ignore[assignment]
            self._fast = True

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        if self._fast and exemplar is None and amount >= 0:
            self._value._value += amount  # type: ignore[attr-defined]
        else:
            super().inc(amount, exemplar)


class LockFreeHistogram(Histogram):
    _fast = False

    def _metric_init(self) -> None:
        super()._metric_init()
        if _local():
            self._sum = _Value()  # type: ignore[assignment]
            self._buckets = [_Value() for _ in self._upper_bounds]  # type: ignore[misc]
            self._fast = True

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if not self._fast or exemplar is not None:
            super().observe(amount, exemplar)
            return
        self._sum._value += amount  # type: ignore[attr-defined]
        if amount == amount:  # NaN falls in no bucket, as in Histogram.observe
            # The first bound >= amount: the bucket Histogram.observe's loop stops at (+Inf is last).
            self._buckets[bisect_left(self._upper_bounds, amount)]._value += 1  # type: ignore[attr-defined]
