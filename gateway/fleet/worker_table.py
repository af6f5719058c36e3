"""One table in shared memory that the worker processes of one gateway all read and write.

Why: with ``server.workers > 1`` every worker routes on its own ``Endpoint`` objects, and
without a shared table each saw only its own in-flight requests — N workers routed as N
half-blind gateways. The parent creates the table (a file, in ``/dev/shm`` where there is
one) before it spawns the workers and removes it when they are gone; each worker maps it.
The parent also clears the cells of a worker that died (``clear_worker``), so its requests
do not stay counted forever.

Layout, all float64 cells, one *row* per endpoint name (``Endpoint.name``, so a data-parallel
rank is a row of its own):

- a 16-byte key (a digest of the name; all zero = free row) and one "in use" flag per worker;
- the load of each worker on that endpoint: requests in flight, their prompt tokens, pending
  prefill tokens. Each of these cells has exactly one writer, its worker, so the hot path
  takes no lock and cannot lose an update; a reader sums the row's columns;
- one breaker record (``BreakerCell``), written under the lock.

After the rows, one heartbeat cell per worker: the ``time.monotonic()`` (one clock for every
process on the host) at which its event loop last ran its beat (:meth:`WorkerTable.beat`). The
parent reads it to find a worker that is alive but no longer serves (a blocked loop, a
SIGSTOP), which no exit would ever report.

Rows are claimed and released under a file lock (``flock``: a process that dies holding it
releases it), only when an endpoint appears in or leaves a worker's fleet; a row is free
again once no worker uses it, and is zeroed when it is claimed. The table is bounded
(``rows``): ``claim`` answers None when it is full, and the caller keeps that endpoint's
counts local (see :mod:`gateway.fleet.shared_load`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["BreakerCell", "LoadCell", "TableSpec", "WorkerTable", "create_table"]

_KEY_BYTES = 16
_KEY_CELLS = _KEY_BYTES // 8
_LOAD = 3  # requests, prompt tokens, pending prefill tokens
_BREAKER = 4  # version, open_until (monotonic), ejections in a row, probe owner (worker + 1; 0: none)
_ZERO_KEY = bytes(_KEY_BYTES)


@dataclass(frozen=True, slots=True)
class TableSpec:
    """What a worker needs to map the table: passed in the worker's arguments."""

    path: str
    rows: int
    workers: int


@dataclass(frozen=True, slots=True)
class BreakerCell:
    """One endpoint's breaker as every worker sees it. ``open_until`` 0: not ejected; while a
    probe is claimed (``probe_owner`` set), when the claim was made or last kept (its lease)."""

    version: int
    open_until: float
    ejections_in_row: int
    probe_owner: int | None  # the worker whose request is the half-open probe


def _size(rows: int, workers: int) -> int:
    return 8 * (rows * (_KEY_CELLS + workers + workers * _LOAD + _BREAKER) + workers)


def create_table(directory: str, rows: int, workers: int) -> TableSpec:
    """The parent's part: a zeroed file of the table's size in ``directory`` (the parent removes it)."""
    path = os.path.join(directory, "load")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, _size(rows, workers))
    finally:
        os.close(fd)
    return TableSpec(path, rows, workers)


class LoadCell:
    """One worker's load cells for one endpoint: the only place that worker writes them.

    Decrements stop at zero, so a request that ended after its endpoint got a row it did
    not count in cannot leave a negative count behind.
    """

    __slots__ = ("_at", "_cells")

    def __init__(self, cells: memoryview, at: int) -> None:
        self._cells = cells
        self._at = at

    def add(self, requests: int, tokens: int) -> None:
        cells, at = self._cells, self._at
        cells[at] = max(0.0, cells[at] + requests)
        cells[at + 1] = max(0.0, cells[at + 1] + tokens)

    def add_pending(self, tokens: float) -> None:
        at = self._at + 2
        self._cells[at] = max(0.0, self._cells[at] + tokens)


class WorkerTable:
    """The table as mapped by one process: a worker (``worker`` = its column) or the parent (None)."""

    def __init__(self, spec: TableSpec, worker: int | None) -> None:
        if worker is not None and not 0 <= worker < spec.workers:
            raise ValueError(f"worker {worker} outside 0..{spec.workers - 1}")
        self.spec = spec
        self.worker = worker
        self._fd = os.open(spec.path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, _size(spec.rows, spec.workers))
        self._bytes = memoryview(self._map)
        self._cells = self._bytes.cast("d")
        rows, workers = spec.rows, spec.workers
        self._users_at = rows * _KEY_CELLS
        self._load_at = self._users_at + rows * workers
        self._breaker_at = self._load_at + rows * workers * _LOAD
        self._beats_at = self._breaker_at + rows * _BREAKER
        self._row_format = struct.Struct(f"{workers * _LOAD}d")

    # ---- rows --------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _key(self, row: int) -> bytes:
        return bytes(self._bytes[row * _KEY_BYTES : (row + 1) * _KEY_BYTES])

    def _users(self, row: int) -> list[float]:
        at = self._users_at + row * self.spec.workers
        return list(self._cells[at : at + self.spec.workers])

    def claim(self, name: str) -> int | None:
        """The row of ``name``, marked as used by this worker; None when the table is full."""
        key = hashlib.blake2b(name.encode(), digest_size=_KEY_BYTES).digest()
        with self._locked():
            free = None
            for row in range(self.spec.rows):
                current = self._key(row)
                if current == key:
                    self._set_user(row, True)
                    return row
                if free is None and current == _ZERO_KEY:
                    free = row
            if free is None:
                return None
            self._zero_row(free)
            self._bytes[free * _KEY_BYTES : (free + 1) * _KEY_BYTES] = key
            self._set_user(free, True)
            return free

    def release(self, row: int) -> None:
        """This worker no longer has the endpoint: its counts there are dropped, the row freed if unused."""
        with self._locked():
            self._drop(row, self._own())

    def clear_worker(self, worker: int) -> None:
        """A worker died (called by the parent): its counts and its claims go, its probes are released."""
        with self._locked():
            self._cells[self._beats_at + worker] = 0.0
            for row in range(self.spec.rows):
                if self._key(row) == _ZERO_KEY:
                    continue
                breaker = self.breaker(row)
                if breaker.probe_owner == worker:
                    self._write_breaker(row, breaker.open_until, breaker.ejections_in_row, None)
                self._drop(row, worker)

    def _own(self) -> int:
        if self.worker is None:
            raise RuntimeError("the parent has no column of its own")
        return self.worker

    def _set_user(self, row: int, used: bool) -> None:
        self._cells[self._users_at + row * self.spec.workers + self._own()] = 1.0 if used else 0.0

    def _drop(self, row: int, worker: int) -> None:
        at = self._load_at + (row * self.spec.workers + worker) * _LOAD
        self._cells[at : at + _LOAD] = memoryview(bytes(8 * _LOAD)).cast("d")
        self._cells[self._users_at + row * self.spec.workers + worker] = 0.0
        if not any(self._users(row)):
            self._bytes[row * _KEY_BYTES : (row + 1) * _KEY_BYTES] = _ZERO_KEY

    def _zero_row(self, row: int) -> None:
        workers = self.spec.workers
        for start, count in (
            (self._users_at + row * workers, workers),
            (self._load_at + row * workers * _LOAD, workers * _LOAD),
            (self._breaker_at + row * _BREAKER, _BREAKER),
        ):
            self._cells[start : start + count] = memoryview(bytes(8 * count)).cast("d")

    def rows_in_use(self) -> int:
        return sum(1 for row in range(self.spec.rows) if self._key(row) != _ZERO_KEY)

    # ---- load ----------------------------------------------------------------------
    def load_cell(self, row: int) -> LoadCell:
        return LoadCell(self._cells, self._load_at + (row * self.spec.workers + self._own()) * _LOAD)

    def row_load(self, row: int) -> tuple[float, float, float]:
        """The whole gateway's (requests, prompt tokens, pending prefill tokens) on this row."""
        return self._sums(self._bytes, 8 * self._load_at + row * self.load_row_bytes)

    @property
    def load_row_bytes(self) -> int:
        """The size of one row's load cells (every worker's) in :meth:`load_snapshot`."""
        return 8 * self.spec.workers * _LOAD

    def load_snapshot(self, rows: int) -> bytes:
        """The load cells of the first ``rows`` rows, copied at once: a reader compares them
        with its last copy and sums only the rows that changed (:meth:`snapshot_load`)."""
        start = 8 * self._load_at
        return self._bytes[start : start + rows * self.load_row_bytes].tobytes()

    def snapshot_load(self, snapshot: bytes, row: int) -> tuple[float, float, float]:
        """:meth:`row_load`, read from a :meth:`load_snapshot`."""
        return self._sums(snapshot, row * self.load_row_bytes)

    def _sums(self, buffer: bytes | memoryview, offset: int) -> tuple[float, float, float]:
        """One row's cells at ``offset``, summed over the workers' columns."""
        values = self._row_format.unpack_from(buffer, offset)
        return sum(values[0::_LOAD]), sum(values[1::_LOAD]), sum(values[2::_LOAD])

    # ---- breaker -------------------------------------------------------------------
    def breaker(self, row: int) -> BreakerCell:
        at = self._breaker_at + row * _BREAKER
        version, open_until, ejections, owner = self._cells[at : at + _BREAKER]
        return BreakerCell(int(version), open_until, int(ejections), int(owner) - 1 if owner else None)

    def breaker_version(self, row: int) -> int:
        """Cheap change check for the refresh path: one cell."""
        return int(self._cells[self._breaker_at + row * _BREAKER])

    def write_breaker(
        self, row: int, open_until: float, ejections_in_row: int, probe_owner: int | None
    ) -> int:
        """Publish a breaker change; returns its version (the writer has seen it already)."""
        with self._locked():
            return self._write_breaker(row, open_until, ejections_in_row, probe_owner)

    def claim_probe(self, row: int, now: float, lease_s: float) -> bool:
        """Half-open: the first worker to ask sends the probe; the others keep the endpoint out.

        A claim lapses unless its owner keeps it (:meth:`keep_probe`, while its probe is in
        flight) within ``lease_s``: a worker that gets no traffic for the endpoint must not
        hold it out of every worker's rotation. A lapsed claim goes to the next to ask."""
        with self._locked():
            breaker = self.breaker(row)
            owner = breaker.probe_owner
            if owner is not None and owner != self._own() and now - breaker.open_until < lease_s:
                return False
            if owner != self._own():
                self._write_breaker(row, now, breaker.ejections_in_row, self._own())
            return True

    def holds_probe(self, row: int) -> bool:
        return self.breaker(row).probe_owner == self._own()

    def keep_probe(self, row: int, now: float) -> bool:
        """Renew this worker's claim (its probe is in flight); False when the claim is not its own."""
        with self._locked():
            breaker = self.breaker(row)
            if breaker.probe_owner != self._own():
                return False
            self._write_breaker(row, max(now, breaker.open_until), breaker.ejections_in_row, self._own())
            return True

    def _write_breaker(self, row: int, open_until: float, ejections: int, owner: int | None) -> int:
        at = self._breaker_at + row * _BREAKER
        version = int(self._cells[at]) + 1
        self._cells[at + 1] = open_until
        self._cells[at + 2] = float(ejections)
        self._cells[at + 3] = 0.0 if owner is None else float(owner + 1)
        self._cells[at] = float(version)  # last: a reader that sees the version sees the record
        return version

    # ---- liveness ------------------------------------------------------------------
    def beat(self, now: float) -> None:
        """This worker's event loop ran at ``now`` (``time.monotonic()``)."""
        self._cells[self._beats_at + self._own()] = now

    def last_beat(self, worker: int) -> float:
        """When ``worker``'s loop last beat; 0.0 if it has not since it (or its slot) started."""
        return self._cells[self._beats_at + worker]

    def close(self) -> None:
        self._cells.release()
        self._bytes.release()
        self._map.close()
        os.close(self._fd)
