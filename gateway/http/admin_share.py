"""Admin API changes made through one worker, replayed by its siblings.

Why: every worker holds its own endpoint list; an admin call reaches the one worker whose
connection it came on. After each change that worker sends its whole admin state — the
``admin`` source's endpoints and the URLs it has draining — to every sibling as one unix
datagram in the gateway's shared directory (0700: the endpoints' API keys travel in it), and
each sibling applies it as its own admin change (``FleetMembership.apply``, drain flags).
The whole state rather than the change, so a sibling applies the same thing whatever it
missed before. Changes are made one at a time across the workers (an exclusive lock on a
file in the shared directory), each on top of the newest state, which carries a sequence
number: two admin calls at the same moment through two workers both take effect, and a
worker never goes back to an older state (without this each of two crossing states replaced
the other, and the two workers kept different fleets).

The state itself goes in a file of the sender's own (``admin-state-<worker>.json``, written
whole and renamed into place), the datagram only names it: endpoints with large labels or
many of them made a state past the datagram limit, and every later change, a drain
included, then never reached the siblings while the admin API answered 200.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from gateway.config import ConfigError, EndpointConfig
from gateway.errors import Conflict
from gateway.fleet.membership import ADMIN_SOURCE
from gateway.fleet.registry import endpoint_from_config
from gateway.http.state import GatewayState
from gateway.ops.shared_files import newest, write_whole
from gateway.ops.sibling_socket import SiblingSocket

__all__ = ["AdminShare"]

log = logging.getLogger(__name__)

_MAX_NOTICE = 4096
_STATE_FILE = re.compile(r"admin-state-[0-9]{1,4}\.json")
_LOCK_WAIT_S = 5.0  # another worker's admin change may hold the lock this long, then a 409


class AdminShare:
    def __init__(self, state: GatewayState, directory: str, worker: int, workers: int) -> None:
        self._state = state
        self._directory = Path(directory)
        self._file = f"admin-state-{worker}.json"
        self._socket = SiblingSocket(directory, "admin", worker, workers, _MAX_NOTICE)
        self._applied = 0  # sequence number of the admin state this worker holds
        # Admin endpoints of that state this worker could not build (a moved CA file): kept in
        # every state it sends, or its next change would remove them from every sibling.
        self._unbuilt: dict[str, EndpointConfig] = {}

    @asynccontextmanager
    async def change(self) -> AsyncIterator[None]:
        """One admin change at a time across the workers, made on the newest admin state and
        sent to the siblings once made (not if the change raised)."""
        lock = os.open(self._directory / "admin.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            loop = asyncio.get_running_loop()
            give_up = loop.time() + _LOCK_WAIT_S
            while True:  # never blocking the loop: the holder may be this very process
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if loop.time() > give_up:
                        busy = "another admin change is in progress; try again"
                        raise Conflict(busy, code="admin_busy") from None
                    await asyncio.sleep(0.005)
            self.catch_up()
            yield
            self.publish()
        finally:
            os.close(lock)  # releases the lock

    def publish(self) -> None:
        """Send this worker's admin state to every sibling (after a change through the admin API)."""
        state = self._state
        self._applied += 1
        message = {
            "seq": self._applied,
            "endpoints": [c.model_dump(mode="json") for c in self._admin_configs()],
            "draining": sorted(e.url for e in state.registry if e.draining),
        }
        write_whole(self._directory / self._file, json.dumps(message).encode())
        failed = self._socket.send(json.dumps({"state": self._file}).encode())
        if failed:  # a sibling gone (the parent logs it) or full: it keeps its previous state
            log.warning("admin change not sent to %d sibling worker(s)", failed)

    def _admin_configs(self) -> list[EndpointConfig]:
        configs = self._state.membership.endpoints_of(ADMIN_SOURCE)
        built = {c.url for c in configs}
        return configs + [c for url, c in self._unbuilt.items() if url not in built]

    def listen(self) -> None:
        self.catch_up()
        self._socket.listen(self._receive)

    def catch_up(self) -> None:
        """Apply the newest admin state any worker wrote (its own dead self's included) if it
        is newer than this worker's: a worker started again after its process died, and every
        admin change before it is made."""
        state = newest(path for path in self._directory.iterdir() if _STATE_FILE.fullmatch(path.name))
        if state is not None:
            self._apply_file(state.name, "written by another worker")

    def _receive(self, datagram: bytes) -> None:
        try:
            notice = json.loads(datagram)
            name = notice["state"] if isinstance(notice, dict) else None
            if not isinstance(name, str) or not _STATE_FILE.fullmatch(name):
                raise ValueError("not an admin-state notice")
        except Exception as exc:  # whatever arrives, the worker keeps serving (logged)
            log.error("admin change from a sibling worker not applied: %s", exc)
            return
        self._apply_file(name, "from a sibling worker")

    def _apply_file(self, name: str, origin: str) -> None:
        try:
            seq, configs, draining = _parse(json.loads((self._directory / name).read_text()))
            if seq <= self._applied:
                return  # this worker holds that state or a newer one
            buildable = _buildable(configs, self._state.membership.holds)
            self._apply(buildable, draining)
            self._unbuilt = {c.url: c for c in configs if c not in buildable}
            self._applied = seq
        except Exception as exc:  # a file half-gone or garbage: the worker keeps serving (logged)
            log.error("admin change %s not applied: %s", origin, exc)

    def _apply(self, configs: list[EndpointConfig], draining: set[str]) -> None:
        state = self._state
        state.membership.apply(ADMIN_SOURCE, configs)
        for endpoint in state.registry:
            endpoint.draining = endpoint.url in draining
        state.registry.rebuild()
        log.info("admin change from a sibling worker applied (%d admin endpoints)", len(configs))

    def close(self) -> None:
        self._socket.close()


def _parse(message: Any) -> tuple[int, list[EndpointConfig], set[str]]:
    """The whole message checked before any of it is applied (never half a change)."""
    if not isinstance(message, dict) or not isinstance(message.get("endpoints"), list):
        raise ValueError("no endpoint list")
    draining = message.get("draining")
    if not isinstance(draining, list) or not all(isinstance(url, str) for url in draining):
        raise ValueError("no draining list")
    seq = message.get("seq", 1)
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise ValueError("no sequence number")
    return seq, [EndpointConfig.model_validate(c) for c in message["endpoints"]], set(draining)


def _buildable(configs: list[EndpointConfig], held: Callable[[EndpointConfig], bool]) -> list[EndpointConfig]:
    """Those this worker can build or has built: one whose file moved since it was added (a
    rotated CA, a token file) is left out and logged, never the reason the worker cannot start,
    and never taken from a worker that built it before the file moved."""
    kept = []
    for config in configs:
        if held(config):
            kept.append(config)
            continue
        try:
            endpoint_from_config(config)
        except ConfigError as exc:
            log.error("admin endpoint %s left out: %s", config.url, exc)
            continue
        kept.append(config)
    return kept
