"""LockFreeCounter / LockFreeHistogram expose exactly what prometheus_client's own do."""

from __future__ import annotations

import math
import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.ops.lockfree import LockFreeCounter, LockFreeHistogram

_CREATED = re.compile(rb"^(\S+_created\S*) \S+$", re.MULTILINE)


def exposition(registry: CollectorRegistry) -> bytes:
    return _CREATED.sub(rb"\1 T", generate_latest(registry))  # creation times differ by run


def feed(counter_cls, histogram_cls) -> bytes:
    r = CollectorRegistry()
    plain = counter_cls("c_plain", "a counter", registry=r)
    labelled = counter_cls("c_labelled", "by label", ["a", "b"], registry=r)
    hist = histogram_cls("h", "a histogram", ["m"], buckets=(0.1, 0.5, 1, 5), registry=r)
    bare = histogram_cls("h_bare", "no labels", registry=r)
    plain.inc()
    plain.inc(2.5)
    for i in range(7):
        labelled.labels("x", str(i % 3)).inc(i)
    labelled.remove("x", "1")
    for value in (0.0, 0.1, 0.10000001, 0.5, 1, 4.99, 5, 5.01, 1e9, -3, math.inf, 0.3):
        hist.labels("m1").observe(value)
        bare.observe(value / 2)
    hist.labels("m2").observe(2)
    return exposition(r)


def test_same_exposition_as_prometheus_client() -> None:
    assert feed(LockFreeCounter, LockFreeHistogram) == feed(Counter, Histogram)


def test_nan_lands_in_no_bucket_like_prometheus_client() -> None:
    def run(cls) -> bytes:
        r = CollectorRegistry()
        cls("h", "nan", buckets=(1,), registry=r).observe(math.nan)
        return exposition(r)

    assert run(LockFreeHistogram) == run(Histogram)


def test_refusals_unchanged() -> None:
    r = CollectorRegistry()
    counter = LockFreeCounter("c", "c", ["a"], registry=r)
    with pytest.raises(ValueError):
        counter.inc()  # a labelled parent is not observable
    with pytest.raises(ValueError):
        counter.labels("x").inc(-1)
    with pytest.raises(ValueError):
        LockFreeHistogram("h", "h", ["a"], registry=r).observe(1)


def test_updates_take_no_lock() -> None:
    counter = LockFreeCounter("c", "c", registry=CollectorRegistry())
    assert not hasattr(counter._value, "_lock")
