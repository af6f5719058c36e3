"""What every discovery source shares: the source protocol, back-off and change publishing.

Endpoint discovery: sources that watch the outside world and report their current endpoint set.

A source never edits the registry itself. It calls ``apply(name, endpoints)`` with its *full* current
list whenever that list changes (and once after its first success); a reconciler merges the sources.
That keeps each source stateless towards the registry and makes "what does source X say right now"
a single value, so a restart or a re-list can never leave a half-applied diff behind.

Errors never shrink the set: a source that cannot reach its authority keeps the last good list and
retries with capped exponential back-off. Only an authoritative answer ("no pods match", NXDOMAIN)
produces an empty list.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from typing import Protocol

from gateway.config import EndpointConfig

__all__ = ["ApplyEndpoints", "Backoff", "DiscoverySource", "Publisher", "no_op"]

log = logging.getLogger(__name__)

ApplyEndpoints = Callable[[str, list[EndpointConfig]], None]
"""``apply(source_name, full_endpoint_list)``: the reconciler's entry point."""


class DiscoverySource(Protocol):
    name: str
    on_failure: Callable[[], None]  # each failed round (counted in /metrics by the wiring)

    async def run(self, apply: ApplyEndpoints) -> None:
        """Run until cancelled; report every change of the endpoint set through ``apply``.

        Never raises except ``CancelledError``; errors are logged and retried with back-off.
        """
        ...


def no_op() -> None:
    """The failure hook of a source nobody counts (tests, the CLI's one-shot listing)."""


class Backoff:
    """Capped exponential back-off with jitter (±20 %), so many gateways do not retry in step."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self._initial = initial_s
        self._max = max(max_s, initial_s)
        self._next = initial_s

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self._max)
        return delay * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self._next = self._initial


class Publisher:
    """Calls ``apply`` only when a source's endpoint set really changed (and always the first time).

    The list is de-duplicated by URL (first wins) and sorted, so equal sets compare equal no matter
    the order the authority returned them in. A failing ``apply`` is logged, never raised into the
    source; the set is then offered again on the next publish.
    """

    def __init__(self, source: str, apply: ApplyEndpoints) -> None:
        self._source = source
        self._apply = apply
        self._last: list[EndpointConfig] | None = None

    @property
    def last(self) -> list[EndpointConfig] | None:
        return None if self._last is None else list(self._last)

    def publish(self, endpoints: Sequence[EndpointConfig]) -> None:
        unique: dict[str, EndpointConfig] = {}
        duplicates = []
        for endpoint in endpoints:
            if endpoint.url in unique:
                duplicates.append(endpoint.url)
            else:
                unique[endpoint.url] = endpoint
        current = [unique[url] for url in sorted(unique)]
        if current == self._last:
            return
        if duplicates:  # logged on a change only: a source re-reports the same set every interval
            log.warning(
                "%s: duplicate endpoints ignored: %s", self._source, ", ".join(sorted(set(duplicates)))
            )
        try:
            self._apply(self._source, list(current))
        except Exception:
            log.exception("%s: applying %d endpoints failed", self._source, len(current))
            return
        added = len({e.url for e in current} - {e.url for e in self._last or []})
        removed = len({e.url for e in self._last or []} - {e.url for e in current})
        log.info("%s: %d endpoints (+%d −%d)", self._source, len(current), added, removed)
        self._last = current
