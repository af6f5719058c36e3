"""Admin API changes made through one worker, replayed by its siblings.

Why: every worker holds its own endpoint list; an admin call reaches the one worker whose
connection it came on. After each change that worker sends its whole admin state — the
``admin`` source's endpoints and the URLs it has draining — to every sibling as one unix
datagram in the gateway's shared directory (0700: the endpoints' API keys travel in it), and
each sibling applies it as its own admin change (``FleetMembership.apply``, drain flags).
The whole state rather than the change, so a sibling applies the same thing whatever it
missed before; two admin changes at the same moment through two workers race (the later
state sent wins), as two writers of one config file would.

The state itself goes in a file of the sender's own (``admin-state-<worker>.json``, written
whole and renamed into place), the datagram only names it: endpoints with large labels or
many of them made a state past the datagram limit, and every later change, a drain
included, then never reached the siblings while the admin API answered 200.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from gateway.config import EndpointConfig
from gateway.fleet.membership import ADMIN_SOURCE
from gateway.http.state import GatewayState
from gateway.ops.shared_files import newest, write_whole
from gateway.ops.sibling_socket import SiblingSocket

__all__ = ["AdminShare"]

log = logging.getLogger(__name__)

_MAX_NOTICE = 4096
_STATE_FILE = re.compile(r"admin-state-[0-9]{1,4}\.json")


class AdminShare:
    def __init__(self, state: GatewayState, directory: str, worker: int, workers: int) -> None:
        self._state = state
        self._directory = Path(directory)
        self._file = f"admin-state-{worker}.json"
        self._socket = SiblingSocket(directory, "admin", worker, workers, _MAX_NOTICE)

    def publish(self) -> None:
        """Send this worker's admin state to every sibling (after a change through the admin API)."""
        state = self._state
        message = {
            "endpoints": [c.model_dump(mode="json") for c in state.membership.endpoints_of(ADMIN_SOURCE)],
            "draining": sorted(e.url for e in state.registry if e.draining),
        }
        write_whole(self._directory / self._file, json.dumps(message).encode())
        failed = self._socket.send(json.dumps({"state": self._file}).encode())
        if failed:  # a sibling gone (the parent logs it) or full: it keeps its previous state
            log.warning("admin change not sent to %d sibling worker(s)", failed)

    def listen(self) -> None:
        self.catch_up()
        self._socket.listen(self._receive)

    def catch_up(self) -> None:
        """A worker started again after its process died applies the newest admin state any
        worker wrote (its own dead self's included): the changes it missed are in it whole."""
        state = newest(path for path in self._directory.iterdir() if _STATE_FILE.fullmatch(path.name))
        if state is not None:
            self._apply_file(state.name, "written before this worker started")

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
            configs, draining = _parse(json.loads((self._directory / name).read_text()))
        except Exception as exc:  # a file half-gone or garbage: the worker keeps serving (logged)
            log.error("admin change %s not applied: %s", origin, exc)
            return
        self._apply(configs, draining)

    def _apply(self, configs: list[EndpointConfig], draining: set[str]) -> None:
        state = self._state
        state.membership.apply(ADMIN_SOURCE, configs)
        for endpoint in state.registry:
            endpoint.draining = endpoint.url in draining
        state.registry.rebuild()
        log.info("admin change from a sibling worker applied (%d admin endpoints)", len(configs))

    def close(self) -> None:
        self._socket.close()


def _parse(message: Any) -> tuple[list[EndpointConfig], set[str]]:
    """The whole message checked before any of it is applied (never half a change)."""
    if not isinstance(message, dict) or not isinstance(message.get("endpoints"), list):
        raise ValueError("no endpoint list")
    draining = message.get("draining")
    if not isinstance(draining, list) or not all(isinstance(url, str) for url in draining):
        raise ValueError("no draining list")
    return [EndpointConfig.model_validate(c) for c in message["endpoints"]], set(draining)
