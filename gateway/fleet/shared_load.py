"""The whole gateway's load on each endpoint, for a worker of a multi-worker gateway.

Routing reads ``Endpoint.in_flight``, ``in_flight_tokens`` and ``pending_prefill_tokens``
(scorers, the saturation detector, the latency model). With one worker those are the
gateway's own numbers. With several, each worker also writes its own changes to its cells
of the shared :class:`~gateway.fleet.worker_table.WorkerTable` (``Endpoint.shared_load``,
set here), and :meth:`SharedLoad.refresh` puts the sum of every worker's cells back into
the fields. Between refreshes a field is the last sum plus this worker's own changes since,
so a worker always sees its own sends at once and its siblings' at its next refresh.

The refresh runs on the request path: before admission at most once per ``interval_s``,
before scheduling always (``force``) — within a throttle window a sibling's request that had
just ended still counted, and its client's next turn, already here, moved its session off
its replica. It copies the table's load cells at once and sums only the rows whose bytes
changed since its last copy: a row whose bytes are equal has the right fields already (its
last sum plus this worker's own changes since), except where a cell's floor at zero
swallowed a decrement, so the first refresh 50 ms after the last full sum sums every row.
A refresh costs the copy, one compare when nothing changed, and per changed row a few
slice compares (bisection) and one ``struct`` read. The hooks' per-request cost stays O(1):
one more cell write per counter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gateway.fleet.endpoint import Endpoint
from gateway.fleet.registry import EndpointRegistry
from gateway.fleet.worker_table import LoadCell, WorkerTable

__all__ = ["SharedLoad"]

log = logging.getLogger(__name__)
_RETRY_S = 0.1  # how often endpoints left out of a full table try for a row again
_FULL_SUM_S = 0.05  # every row summed at least this often, changed or not


@dataclass(eq=False, slots=True)
class _Binding:
    row: int
    cell: LoadCell
    endpoints: list[Endpoint] = field(default_factory=list)  # every object that wrote here


class SharedLoad:
    """Binds this worker's endpoints to table rows (by name) and sums the rows back into them."""

    def __init__(
        self,
        table: WorkerTable,
        registry: EndpointRegistry,
        on_full: Callable[[str], None] | None = None,
        interval_s: float = 0.001,
    ) -> None:
        self.table = table
        self._registry = registry
        self._on_full = on_full
        self._interval_s = interval_s
        self._bound: dict[str, _Binding] = {}
        self._unshared: set[str] = set()  # names the full table had no row for (logged once)
        self._seen_version = -1
        self._summed_at = -1.0
        self._retry_at = 0.0
        self._full_at = 0.0  # when every row was last summed
        self._snapshot: bytes | None = None  # the load cells as last summed (None: sum every row)
        self._rows = 0  # how many rows to copy: up to this worker's highest bound row
        self._by_row: dict[int, _Binding] = {}

    def row(self, endpoint: Endpoint) -> int | None:
        binding = self._bound.get(endpoint.name)
        return binding.row if binding is not None else None

    def refresh(self, *, force: bool = False) -> None:
        """Bind new endpoints (always), then the fleet-wide sums (always with ``force``, else at
        most once per ``interval_s``).

        Endpoints the full table had no row for are tried again every ``_RETRY_S``: a row
        freed by another worker's endpoint leaving changes nothing in this worker's registry.
        """
        now = time.monotonic()
        if self._registry.version != self._seen_version or (self._unshared and now >= self._retry_at):
            self._retry_at = now + _RETRY_S
            self._rebind()
        if not force and now - self._summed_at < self._interval_s:
            return
        self._summed_at = now
        table = self.table
        snapshot, last = table.load_snapshot(self._rows), self._snapshot
        if now >= self._full_at + _FULL_SUM_S:
            # Every row now and then: a decrement that a cell's floor at zero swallowed (a request
            # counted before its endpoint's row was bound) changed a field and no byte.
            self._full_at, last = now, None
        if snapshot == last:
            return  # no worker changed a count since the last sum: the fields are right
        self._snapshot = snapshot
        # a row unchanged keeps its fields: its last sum plus our own changes since
        rows = self._by_row if last is None else _changed_rows(snapshot, last, table.load_row_bytes)
        for row in rows:
            binding = self._by_row.get(row)
            if binding is None:
                continue
            requests, tokens, pending = table.snapshot_load(snapshot, row)
            for endpoint in binding.endpoints:
                endpoint.in_flight = round(requests)
                endpoint.in_flight_tokens = round(tokens)
                endpoint.pending_prefill_tokens = pending

    def _rebind(self) -> None:
        self._seen_version = self._registry.version
        self._snapshot = None  # new endpoint objects (and rows) take their sums at the next refresh
        by_name: dict[str, list[Endpoint]] = {}
        for endpoint in self._registry.targets():
            by_name.setdefault(endpoint.name, []).append(endpoint)
        for name in [n for n in self._bound if n not in by_name]:
            self._unbind(name)
        for name, endpoints in by_name.items():
            binding = self._bound.get(name) or self._bind(name)
            if binding is None:
                continue
            for endpoint in endpoints:
                if endpoint.shared_load is not binding.cell:
                    endpoint.shared_load = binding.cell
                    binding.endpoints.append(endpoint)
        self._by_row = {binding.row: binding for binding in self._bound.values()}
        self._rows = 1 + max(self._by_row, default=-1)

    def _bind(self, name: str) -> _Binding | None:
        row = self.table.claim(name)
        if row is None:
            if name not in self._unshared:  # logged and counted once per endpoint, not per retry
                self._unshared.add(name)
                log.warning(
                    "worker table full (%d rows): endpoint %s is counted by this worker only",
                    self.table.spec.rows,
                    name,
                )
                if self._on_full is not None:
                    self._on_full(name)
            return None
        binding = self._bound[name] = _Binding(row, self.table.load_cell(row))
        if name in self._unshared:  # what it counted alone until now moves into its cells
            self._unshared.discard(name)
            for endpoint in self._registry.targets():
                if endpoint.name == name:
                    binding.cell.add(endpoint.in_flight, endpoint.in_flight_tokens)
                    binding.cell.add_pending(endpoint.pending_prefill_tokens)
        return binding

    def _unbind(self, name: str) -> None:
        binding = self._bound.pop(name)
        for endpoint in binding.endpoints:  # requests still running there now count locally only
            endpoint.shared_load = None
        self.table.release(binding.row)

    def close(self) -> None:
        for name in list(self._bound):
            self._unbind(name)


def _changed_rows(snapshot: bytes, last: bytes, row_bytes: int) -> Iterator[int]:
    """The rows whose bytes differ, lowest first, by bisection: a range whose bytes are equal
    in both copies (two slices, compared in C) is skipped whole. So O(k log(n/k)) compares for
    k changed rows of n, never more than ~2n of them: no cliff as more rows change."""
    ranges = [(0, len(snapshot) // row_bytes)]
    while ranges:
        low, high = ranges.pop()
        start, end = low * row_bytes, high * row_bytes
        if snapshot[start:end] == last[start:end]:
            continue
        if high - low == 1:
            yield low
            continue
        middle = (low + high) // 2
        ranges += ((middle, high), (low, middle))  # the lower half first
