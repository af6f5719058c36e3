"""Hot reload of the config file (SIGHUP, and a watch on the file's content).

A new config is validated completely — schema, plugin types, profiles, endpoint
files — before anything changes; an invalid one is rejected with a log line and a
counter, and the old config stays in force. A valid one is applied in place:
endpoints (added/removed through ``FleetMembership``; in-flight requests finish on
the endpoints they were sent to), the routing policy (a new scheduler *and* the hook
chain built for it, swapped together, for the next request), admission limits,
timeouts, retries and breaker settings, health checks and scrapes (intervals, timeouts,
thresholds, from their next round), model aliases and split weights.

Sections that own sockets or background tasks (``server``, ``prefix``, ``sessions``,
``pd``, ``discovery``, the auth backends, ``scrape.enabled``, the upstream connection pools'
sizes) need a restart; a change there is logged and the running values are kept. Every other
section applies (``autoscale`` from the next scrape of ``/metrics``, ``log_level`` at once).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.auth.keyfile import KeyFileError, load_keys_file
from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.fleet.membership import CONFIG_SOURCE
from gateway.fleet.registry import endpoint_from_config
from gateway.http.app import parse_options, proxy_settings
from gateway.http.routing import build_routing
from gateway.http.state import GatewayState

__all__ = ["APPLIED", "RESTART_ONLY", "ConfigReloader", "apply_config"]

log = logging.getLogger(__name__)

RESTART_ONLY = ("server", "prefix", "sessions", "pd", "discovery")
# Fields of applied sections that still need a restart: they built sockets, pools or tasks.
_FIELDS_RESTART_ONLY = {
    "auth": ("backend", "redis_url", "key_prefix", "limits_backend", "enabled", "keys_file"),
    "scrape": ("enabled",),  # whether the poller runs at all
    "limits": ("upstream_connections", "upstream_connections_per_endpoint"),  # the connection pools
}
# Every other section, applied in place by apply_config (tests/web/test_reload_every_section.py
# checks that each section of GatewayConfig is in exactly one of the two lists).
APPLIED = (
    "endpoints", "health", "scrape", "timeouts", "limits", "admission", "autoscale", "resilience",
    "auth", "models", "policy", "plugins", "profiles", "log_level",
)  # fmt: skip


def _keep_restart_only(old: GatewayConfig, new: GatewayConfig) -> GatewayConfig:
    kept: dict[str, Any] = {}
    for section in RESTART_ONLY:
        if getattr(old, section) != getattr(new, section):
            log.warning("config reload: %r changed; it takes effect after a restart", section)
            kept[section] = getattr(old, section)
    for section, fields in _FIELDS_RESTART_ONLY.items():
        was, now = getattr(old, section), getattr(new, section)
        changed = {f: getattr(was, f) for f in fields if getattr(was, f) != getattr(now, f)}
        if changed:
            log.warning(
                "config reload: %s changed; it takes effect after a restart",
                ", ".join(f"{section}.{f}" for f in changed),
            )
            kept[section] = now.model_copy(update=changed)
    return new.model_copy(update=kept) if kept else new


async def apply_config(state: GatewayState, new: GatewayConfig) -> None:
    """Validate everything first (raises ConfigError, nothing changed), then swap in place.

    Endpoints change make-before-break: new ones join and are probed first, old ones
    leave after, so replacing the whole fleet never opens a window with no endpoint.
    """
    new = _keep_restart_only(state.config, new)
    routing = build_routing(
        new, state.plugin_registry, state.plugin_context, state.breakers, state.health.mark_failed
    )
    for endpoint in new.endpoints:  # an unreadable token or CA file rejects the whole reload
        endpoint_from_config(endpoint)
    if state.auth is not None and new.auth.backend == "file" and new.auth.keys_file:
        try:
            load_keys_file(new.auth.keys_file)  # checked now; applied with everything else below
        except KeyFileError as exc:
            raise ConfigError(f"auth.keys_file: {exc}") from None
    if not new.endpoints and not new.discovery.kubernetes and not new.discovery.dns:
        raise ConfigError("endpoints: a reload may not remove every endpoint")

    current = state.membership.endpoints_of(CONFIG_SOURCE)
    joining = [e for e in new.endpoints if e not in current]
    if joining:
        state.membership.apply(CONFIG_SOURCE, [*current, *joining])
        if state.probe is not None:
            await state.probe([e for c in joining if (e := state.registry.get(c.url)) is not None])
    state.membership.apply(CONFIG_SOURCE, new.endpoints)
    state.routing = routing
    state.admission.reconfigure(new.admission)
    if state.plugin_context.latency is not None:
        slo = new.admission.slo
        state.plugin_context.latency.reconfigure(
            horizon=slo.horizon, min_samples=slo.min_samples, training_per_s=slo.training_per_s
        )
    state.health.reconfigure(new.health)
    if state.health_checker is not None:
        state.health_checker.reconfigure(new.health)
    if state.poller is not None:
        state.poller.reconfigure(new.scrape)
    state.breakers.reconfigure(new.resilience)
    if state.proxy is not None:
        settings = proxy_settings(new)
        if new.resilience == state.config.resilience:  # the budget keeps what it has counted
            settings = dataclasses.replace(settings, retry_budget=state.proxy.settings.retry_budget)
        state.proxy.reconfigure(settings)
    state.parse_options = parse_options(new)
    if state.aliases is not None:
        state.aliases.reconfigure(new.models)
    if state.auth is not None:
        state.auth.reconfigure(new.auth)
    if new.log_level != state.config.log_level:
        logging.getLogger().setLevel(new.log_level.upper())
    state.config = new  # the autoscale signal reads its section from here at each scrape


class ConfigReloader:
    """Re-reads the file the gateway was started with (CLI flags still win over it)."""

    def __init__(
        self,
        state: GatewayState,
        path: str | Path,
        overrides: dict[str, Any] | None = None,
        digest: bytes | None = None,
        on_applied: Callable[[], None] | None = None,
    ) -> None:
        """``digest``: of the file the running config came from, when that is not the file as
        it is now (a worker started again with its siblings' config: a change since is then
        reloaded by the watch). ``on_applied``: called after each applied reload."""
        self._state = state
        self._path = Path(path)
        self._overrides = overrides or {}
        self._digest = digest if digest is not None else self._read_digest()
        self._on_applied = on_applied
        self._tasks: set[asyncio.Task[str]] = set()
        self._lock = asyncio.Lock()  # a SIGHUP during a watch-triggered reload waits its turn
        # Every result exported at 0 from the start: a counter born at 1 by the first rejection
        # shows Prometheus no increase, and LLMGatewayConfigReloadRejected would never fire for it.
        for result in ("applied", "rejected", "unchanged"):
            state.metrics.config_reloads.labels(result)

    @property
    def digest(self) -> bytes | None:
        """Of the file as last read (at start, or by the last reload)."""
        return self._digest

    def reload_soon(self) -> None:
        """For the SIGHUP handler: reload in a task (signal handlers cannot await)."""
        task = asyncio.get_running_loop().create_task(self.reload())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _read_digest(self) -> bytes | None:
        try:
            return hashlib.sha256(self._path.read_bytes()).digest()
        except OSError:
            return None

    async def reload(self) -> str:
        """Returns ``applied``, ``rejected`` or ``unchanged`` (also counted in /metrics)."""
        async with self._lock:
            return await self._reload()

    async def _reload(self) -> str:
        metrics = self._state.metrics
        self._digest = self._read_digest()
        try:
            new = load_config(self._path, overrides=self._overrides)
            if new == self._state.config:
                result = "unchanged"
                if self._state.auth is not None:
                    self._state.auth.reconfigure(new.auth)  # SIGHUP also re-reads the keys file
            else:
                await apply_config(self._state, new)
                result = "applied"
                log.warning("config reload: applied %s", self._path)
                if self._on_applied is not None:
                    self._on_applied()
        except ConfigError as exc:
            result = "rejected"
            log.error("config reload: rejected %s, keeping the running config: %s", self._path, exc)
        except Exception:  # anything else (a plugin failing oddly): counted, never a silent task death
            result = "rejected"
            log.exception("config reload: rejected %s, keeping the running config", self._path)
        metrics.config_reloads.labels(result).inc()
        return result

    async def watch(self, interval_s: float = 2.0) -> None:
        """Poll the file's content (a Kubernetes ConfigMap update swaps a symlink; mtimes lie),
        and the API keys file, which a mounted Secret updates on its own schedule."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                digest = self._read_digest()
                if digest is not None and digest != self._digest:
                    await self.reload()
                elif self._state.auth is not None:
                    self._state.auth.reload_keys_if_changed()  # a Secret update swaps the file in place
            except Exception:  # e.g. a third-party plugin failing oddly: keep watching
                log.exception("config watch: reload failed; the running config stays")
