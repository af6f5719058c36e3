"""Runs scheduling profiles for a request: filters → weighted scorers → picker, per profile."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.errors import NoHealthyEndpoint
from gateway.fleet.endpoint import Endpoint
from gateway.ops.metrics import GatewayMetrics
from gateway.request.types import InferenceRequest
from gateway.scheduling.framework import (
    Filter,
    Picker,
    PluginKind,
    PreparingPlugin,
    ProfileHandler,
    Scorer,
)
from gateway.scheduling.result import SchedulingResult, ScoredEndpoint

__all__ = ["PLUGIN_TIMING_EVERY", "Profile", "Scheduler", "WeightedScorer"]

# Plugin latency histograms sample one request in this many: the observations (a lock
# and a bucket search each, for every plugin) cost more than most plugins themselves.
PLUGIN_TIMING_EVERY = 8
_FAILURE_LOG_EVERY_S = 60.0

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[WeightedScorer, ...]
    picker: Picker


class Scheduler:
    """Stateless runner over immutable profiles; plugins keep their own (bounded) state."""

    def __init__(
        self,
        profiles: dict[str, Profile],
        handler: ProfileHandler,
        metrics: GatewayMetrics,
    ) -> None:
        self.profiles = profiles
        self.handler = handler
        self._metrics = metrics
        self._profile_names = tuple(profiles)
        # (kind, name) → histogram child, resolved once
        self._plugin_timer: dict[tuple[PluginKind, str], Any] = {}
        self._requests = 0
        self._failure_logged: dict[str, float] = {}  # plugin name -> when its failure was last logged
        self.preparers = [
            ws.scorer
            for profile in profiles.values()
            for ws in profile.scorers
            if isinstance(ws.scorer, PreparingPlugin)
        ]

    def _failed(self, kind: PluginKind, name: str) -> None:
        """A plugin raised: logged with its traceback, at most once a minute per plugin (a
        third-party scorer that divided by zero for some prompts made those requests 500s)."""
        now = time.monotonic()
        if now - self._failure_logged.get(name, -_FAILURE_LOG_EVERY_S) >= _FAILURE_LOG_EVERY_S:
            self._failure_logged[name] = now
            log.exception(
                "%s plugin %r failed; skipped for this request (logged once a minute)", kind.value, name
            )

    def _timer(self, kind: PluginKind, name: str):
        key = (kind, name)
        child = self._plugin_timer.get(key)
        if child is None:
            child = self._metrics.plugin_latency.labels(kind.value, name)
            self._plugin_timer[key] = child
        return child

    async def schedule(self, request: InferenceRequest, endpoints: Sequence[Endpoint]) -> SchedulingResult:
        started = time.perf_counter()
        for plugin in self.preparers:
            try:
                await plugin.prepare(request, endpoints)
            except Exception:  # its scores then come from what it has, or are skipped too
                self._failed(PluginKind.SCORER, getattr(plugin, "name", type(plugin).__name__))
        results: dict[str, list[ScoredEndpoint]] = {}
        self._requests += 1
        timed = self._requests % PLUGIN_TIMING_EVERY == 0
        explain = request.debug or log.isEnabledFor(logging.DEBUG)
        while True:
            to_run = self.handler.pick_profiles(request, self._profile_names, results)
            if not to_run:
                break
            for name in to_run:
                try:
                    results[name] = self._run_profile(self.profiles[name], request, endpoints, timed, explain)
                except NoHealthyEndpoint:
                    if not self.handler.without_candidates(request, name):
                        raise
                    results[name] = []  # ran, and ranked no one: the handler goes on without it
        primary = self.handler.primary_profile(request, results)
        prefill = self.handler.prefill_profile(request, results)
        self._metrics.scheduling_latency.observe(time.perf_counter() - started)
        result = SchedulingResult(results, primary, prefill)
        if explain:
            log.debug("request %s model=%s scores: %s", request.request_id, request.model, result.explain())
        return result

    def _run_profile(
        self,
        profile: Profile,
        request: InferenceRequest,
        endpoints: Sequence[Endpoint],
        timed: bool,
        explain: bool,
    ) -> list[ScoredEndpoint]:
        """``explain`` keeps every plugin's score per candidate (debug header and log line)."""
        candidates: list[Endpoint] = list(endpoints)
        for flt in profile.filters:
            t0 = time.perf_counter() if timed else 0.0
            try:
                candidates = flt.filter(request, candidates)
            except Exception:  # a filter is a constraint (a pool's role, residency): fails closed
                self._failed(PluginKind.FILTER, flt.name)
                candidates = []
            if timed:
                self._timer(PluginKind.FILTER, flt.name).observe(time.perf_counter() - t0)
            if not candidates:
                raise NoHealthyEndpoint(
                    f"no endpoint can serve model {request.model!r}: all candidates removed by"
                    f" filter {flt.name!r} in profile {profile.name!r}"
                )
        totals = dict.fromkeys(candidates, 0.0)
        per_plugin: dict[Endpoint, dict[str, float]] = (
            {endpoint: {} for endpoint in candidates} if explain else {}
        )
        for weighted in profile.scorers:
            scorer = weighted.scorer
            t0 = time.perf_counter() if timed else 0.0
            try:
                raw = scorer.score(request, candidates)
            except Exception:  # a plugin's fault costs its own say in this request, not the request
                self._failed(PluginKind.SCORER, scorer.name)
                raw = {}
            if timed:
                self._timer(PluginKind.SCORER, scorer.name).observe(time.perf_counter() - t0)
            name, weight = scorer.name, weighted.weight
            for endpoint in candidates:
                value = raw.get(endpoint, 0.0)
                if not 0.0 <= value <= 1.0:  # clamp; NaN fails both bounds and becomes 0
                    value = 1.0 if value > 1.0 else 0.0
                if explain:
                    per_plugin[endpoint][name] = value
                totals[endpoint] += weight * value
        scored = [ScoredEndpoint(e, totals[e], per_plugin.get(e, {})) for e in candidates]
        t0 = time.perf_counter() if timed else 0.0
        ranked = profile.picker.pick(request, scored)
        if timed:
            self._timer(PluginKind.PICKER, profile.picker.name).observe(time.perf_counter() - t0)
        return ranked
