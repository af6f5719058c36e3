"""Breaker states shared by the workers of one gateway, through the shared worker table.

Why: each worker judges endpoints by the requests *it* sent. Without sharing, a replica
that fails every request is ejected by the worker that saw three failures and still sent
traffic by the others, each of which has to fail its own requests first — and each
half-opened on its own, so N workers sent N probes. With this:

- an ejection (its deadline and how many in a row) is published in the endpoint's row, and
  every sibling takes the endpoint out of rotation at its next review (``check_interval_s``);
- when the deadline passes, the first worker to claim the probe sends it; the others keep
  the endpoint out until that probe's verdict is published (closed, or ejected again). The
  claim is a lease, renewed by its owner while its probe is in flight: a worker that claimed
  it and has no request for the endpoint lets it lapse, and the next worker to ask takes it;
- a worker that dies releases its probe (the parent clears it), so another can claim it.

Rows are the load table's (``SharedLoad``, by endpoint name): an endpoint without a row (a
full table, a data-parallel replica whose rows are its ranks') keeps a per-worker breaker.
"""

from __future__ import annotations

from gateway.fleet.endpoint import Endpoint
from gateway.fleet.shared_load import SharedLoad
from gateway.fleet.worker_table import BreakerCell

__all__ = ["SharedBreakerStates"]


class SharedBreakerStates:
    def __init__(self, shared: SharedLoad) -> None:
        self._shared = shared
        self._table = shared.table
        self._seen: dict[str, int] = {}  # endpoint URL → the last version this worker acted on

    def publish(self, endpoint: Endpoint, open_until: float, ejections_in_row: int) -> None:
        """This worker ejected (``open_until`` > 0) or closed (0) the endpoint's breaker."""
        row = self._shared.row(endpoint)
        if row is not None:
            self._seen[endpoint.url] = self._table.write_breaker(row, open_until, ejections_in_row, None)

    def claim_probe(self, endpoint: Endpoint, now: float, lease_s: float) -> bool:
        """Half-open: may this worker send the probe? (Always, for an endpoint without a row.)"""
        row = self._shared.row(endpoint)
        if row is None:
            return True
        claimed = self._table.claim_probe(row, now, lease_s)
        self._seen[endpoint.url] = self._table.breaker_version(row)
        return claimed

    def keep_probe(self, endpoint: Endpoint, now: float) -> bool:
        """Renew the claim while the probe is in flight; False: the claim is no longer this
        worker's (it lapsed unused and a sibling took it)."""
        row = self._shared.row(endpoint)
        if row is None:
            return True
        kept = self._table.keep_probe(row, now)
        self._seen[endpoint.url] = self._table.breaker_version(row)
        return kept

    def holds_probe(self, endpoint: Endpoint) -> bool:
        """Whether this worker's claim on the probe still stands."""
        row = self._shared.row(endpoint)
        return row is None or self._table.holds_probe(row)

    def forget(self, url: str) -> None:
        """The endpoint left: a row it gets when it comes back starts over at version 0, and
        the version remembered from before would hide that row's first changes."""
        self._seen.pop(url, None)

    def changed(self, endpoint: Endpoint) -> BreakerCell | None:
        """A sibling's change to this endpoint's breaker not yet acted on here, else None."""
        row = self._shared.row(endpoint)
        if row is None:
            return None
        version = self._table.breaker_version(row)
        if version == self._seen.get(endpoint.url, 0):
            return None
        self._seen[endpoint.url] = version
        return self._table.breaker(row)
