"""Admin API changes made through one worker, replayed by its siblings.

Why: every worker holds its own endpoint list; an admin call reaches the one worker whose
connection it came on. After each change that worker sends its whole admin state — the
``admin`` source's endpoints and the URLs it has draining — to every sibling as one unix
datagram in the gateway's shared directory (0700: the endpoints' API keys travel in it), and
each sibling applies it as its own admin change (``FleetMembership.apply``, drain flags).
The whole state rather than the change, so a sibling applies the same thing whatever it
missed before; two admin changes at the same moment through two workers race (the later
state sent wins), as two writers of one config file would.
"""

from __future__ import annotations

import json
import logging

from gateway.config import ConfigError, EndpointConfig
from gateway.fleet.membership import ADMIN_SOURCE
from gateway.http.state import GatewayState
from gateway.ops.sibling_socket import SiblingSocket

__all__ = ["AdminShare"]

log = logging.getLogger(__name__)

_MAX_DATAGRAM = 1 << 20


class AdminShare:
    def __init__(self, state: GatewayState, directory: str, worker: int, workers: int) -> None:
        self._state = state
        self._socket = SiblingSocket(directory, "admin", worker, workers, _MAX_DATAGRAM)

    def publish(self) -> None:
        """Send this worker's admin state to every sibling (after a change through the admin API)."""
        state = self._state
        message = {
            "endpoints": [c.model_dump(mode="json") for c in state.membership.endpoints_of(ADMIN_SOURCE)],
            "draining": sorted(e.url for e in state.registry if e.draining),
        }
        failed = self._socket.send(json.dumps(message).encode())
        if failed:  # a sibling gone (the parent logs it) or full: it keeps its previous state
            log.warning("admin change not sent to %d sibling worker(s)", failed)

    def listen(self) -> None:
        self._socket.listen(self._receive)

    def _receive(self, datagram: bytes) -> None:
        try:
            self._apply(json.loads(datagram))
        except (ValueError, KeyError, TypeError, ConfigError) as exc:
            log.error("admin change from a sibling worker not applied: %s", exc)

    def _apply(self, message: dict) -> None:
        state = self._state
        configs = [EndpointConfig.model_validate(c) for c in message["endpoints"]]
        state.membership.apply(ADMIN_SOURCE, configs)
        draining = set(message["draining"])
        for endpoint in state.registry:
            endpoint.draining = endpoint.url in draining
        state.registry.rebuild()
        log.info("admin change from a sibling worker applied (%d admin endpoints)", len(configs))

    def close(self) -> None:
        self._socket.close()
