"""An online latency model per replica, trained from the gateway's own observations.

For streamed answers the gateway records the replica's state when it sent the request
(features) and what happened (TTFT, then the time per output token) — every answer up to
``training_per_s`` a second per replica, a sample of them past it — and fits

    TTFT ≈ θ₀ + θ₁·prefill_tokens + θ₂·queued + θ₃·in_flight + θ₄·kv_usage
    TPOT ≈ φ₀ + φ₁·in_flight + φ₂·kv_usage

per replica, in milliseconds:

- ``prefill_tokens`` = this request's uncached prompt tokens (the prefix index's
  :meth:`~gateway.prefix.cache.PrefixCache.uncached_tokens`, so a prefix hit is
  worth exactly the prefill it saves) + the replica's ``pending_prefill_tokens`` (prefill
  the gateway sent that has not produced a first token). One coefficient for both: the
  engine prefills them at the same rate, so the cost of a prefill *queue* is learned from
  requests that met none;
- ``queued``: the saturation detector's waiting estimate (burst-correct: in-flight beyond
  the batch capacity counts as queued at once);
- ``in_flight``: the gateway's own count; ``kv_usage``: the detector's estimate now.

The fit is exponentially weighted least squares (memory ``horizon`` observations) with a
ridge pull toward a prior — the fleet's pooled fit for a replica, a generic guess for the
fleet — so a cold replica predicts like its siblings and a handful of samples cannot
produce wild coefficients. Coefficients are kept ≥ 0 (more work never makes a replica
faster: an active-set solve drops a negative one), and residuals beyond 3× the running
mean absolute residual are down-weighted (a preempted request must not tilt the fit).
One fit serves every class, but classes do not wait alike (with the engine's priority
scheduling a sheddable request waits behind everything): a multiplicative bias per
priority, the running mean of observed / predicted, corrects the prediction for a class.
Pure Python on 5×5 matrices: an observation costs tens of microseconds, a prediction a
dot product. Nothing here blocks or does I/O.
"""

from __future__ import annotations

import math
import operator
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.admission.saturation import SaturationDetector
from gateway.fleet.endpoint import Endpoint

__all__ = ["TPOT_FEATURES", "TTFT_FEATURES", "LatencyModel", "LatencySample", "OnlineLinearModel", "Training"]

TTFT_FEATURES = ("intercept", "prefill_tokens", "queued", "in_flight", "kv_usage")
_TTFT_SCALE = (1.0, 1000.0, 1.0, 4.0, 1.0)  # typical magnitudes: the ridge acts per typical unit
_TTFT_PRIOR = (20.0, 0.03, 50.0, 2.0, 0.0)  # ms (per token, per request …): weak, for a cold fleet
TPOT_FEATURES = ("intercept", "in_flight", "kv_usage")
_TPOT_SCALE = (1.0, 4.0, 1.0)
_TPOT_PRIOR = (10.0, 0.5, 0.0)
_FLOOR_MS = 0.1
_MAX_FEATURE = 1e6  # in typical units (the scales): beyond it a feature is garbage, not load


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(vector)
    a = [[*row, vector[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        head = a[col]
        for r in range(col + 1, n):
            factor = a[r][col] / head[col]
            if factor:
                row = a[r]
                for c in range(col, n + 1):
                    row[c] -= factor * head[c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (a[r][n] - sum(a[r][c] * out[c] for c in range(r + 1, n))) / a[r][r]
    return out


class OnlineLinearModel:
    """``y ≈ θ·x``: exponentially weighted ridge least squares toward a prior, with ``θ ≥ 0``."""

    def __init__(self, scale: Sequence[float], *, horizon: int = 500, ridge: float = 1.0) -> None:
        self.dim = len(scale)
        self._scale = tuple(scale)
        self._horizon = horizon
        self._decay = 1.0 - 1.0 / horizon
        self._ridge = ridge
        # XᵀX is symmetric: its upper triangle, row by row, one flat list (an update is one pass)
        self._pairs = tuple((i, j) for i in range(self.dim) for j in range(i, self.dim))
        self._xtx = [0.0] * len(self._pairs)
        self._xty = [0.0] * self.dim
        self._abs_residual = 0.0
        self.samples = 0
        self.theta: tuple[float, ...] = (0.0,) * self.dim

    def predict(self, x: Sequence[float]) -> float:
        return max(_FLOOR_MS, sum(map(operator.mul, self.theta, x)))

    def observe(self, x: Sequence[float], y: float, prior: Sequence[float]) -> None:
        z = list(map(operator.truediv, x, self._scale))
        if len(z) != self.dim:
            raise ValueError(f"{len(z)} features for a model of {self.dim}")
        biggest = max(map(abs, z))
        if not math.isfinite(y) or not biggest <= _MAX_FEATURE or math.isnan(sum(z)):
            return  # garbage in (a broken scrape): one such sample once poisoned the fit for good
        predicted = self.predict(x)
        residual = abs(y - predicted)
        # The residual scale: the running mean absolute residual once it rests on a few samples;
        # before that the prediction itself (the prior's), so a cold engine's first answer
        # (graph capture, 6 s against a few ms after) is down-weighted like any other outlier.
        scale = self._abs_residual if self.samples >= 4 else max(self._abs_residual, predicted)
        weight = 3 * scale / residual if residual > 3 * scale > 0 else 1.0
        rate = max(0.05, 1 / (self.samples + 1))
        self._abs_residual += rate * (min(residual, 3 * scale) - self._abs_residual)
        decay = self._decay
        wz = [v * weight for v in z]
        self._xtx = [decay * a + wz[i] * z[j] for a, (i, j) in zip(self._xtx, self._pairs, strict=True)]
        self._xty = [decay * a + w * y for a, w in zip(self._xty, wz, strict=True)]
        self.samples += 1
        # A refit costs ~40 µs: on every answer while the fit is young, then every 16th, and
        # every 64th once the memory is full (the fit moves by 1/horizon an answer by then).
        every = 1 if self.samples <= 16 else 16 if self.samples <= self._horizon else 64
        if self.samples % every == 0:
            self.fit(prior)

    def fit(self, prior: Sequence[float]) -> None:
        """Refit against ``prior`` (in the features' units); drops coefficients that go negative."""
        scaled_prior = [p * s for p, s in zip(prior, self._scale, strict=True)]
        free = list(range(self.dim))
        solution: dict[int, float] = {}
        xtx = [[0.0] * self.dim for _ in range(self.dim)]
        for value, (i, j) in zip(self._xtx, self._pairs, strict=True):
            xtx[i][j] = xtx[j][i] = value
        while free:
            matrix = [[xtx[i][j] + (self._ridge if i == j else 0.0) for j in free] for i in free]
            vector = [self._xty[i] + self._ridge * scaled_prior[i] for i in free]
            phi = _solve(matrix, vector)
            if phi is None:
                return
            solution = dict(zip(free, phi, strict=True))
            worst = min(free, key=lambda i: solution[i])
            if solution[worst] >= 0:
                break
            free.remove(worst)
            solution = {}
        theta = tuple(solution.get(i, 0.0) / self._scale[i] for i in range(self.dim))
        if all(math.isfinite(t) for t in theta):
            self.theta = theta

    def set_horizon(self, horizon: int) -> None:
        self._horizon = horizon
        self._decay = 1.0 - 1.0 / horizon

    def set_prior(self, prior: Sequence[float]) -> None:
        """Before any observation: predict ``prior`` (a cold model has nothing better)."""
        if not self.samples:
            self.theta = tuple(prior)


@dataclass(slots=True)
class LatencySample:
    """One attempt's features and predictions at send, filled in as the answer arrives."""

    endpoint: str
    ttft_x: tuple[float, ...]
    tpot_x: tuple[float, ...]
    predicted_ttft_ms: float
    sent_at: float
    training: Training
    first_byte_at: float | None = None
    completion_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Training:
    """Which models an answer trains: its replica's, the fleet's pooled one, or both."""

    replica: bool
    fleet: bool


_BOTH = Training(replica=True, fleet=True)
_TRAININGS = {(True, False): Training(True, False), (False, True): Training(False, True)}  # no allocation


class _TrainingBudget:
    """A token bucket of answers per second (burst: one second's worth, at least one answer). An
    online fit gains little from the thousandth answer in a second, and each observation costs
    ~5 µs on the request path; at a low rate (a real engine's) every answer trains."""

    __slots__ = ("_at", "_tokens")

    def __init__(self, rate: float, now: float) -> None:
        self._tokens = max(1.0, rate)
        self._at = now

    def take(self, rate: float, now: float) -> bool:
        # A bucket smaller than one answer (a rate below 1/s) would never train at all.
        tokens = min(max(1.0, rate), self._tokens + (now - self._at) * rate)
        self._at = now
        if tokens >= 1.0:
            self._tokens = tokens - 1.0
            return True
        self._tokens = tokens
        return False


class _Replica:
    __slots__ = ("tpot", "ttft")

    def __init__(self, horizon: int) -> None:
        self.ttft = OnlineLinearModel(_TTFT_SCALE, horizon=horizon)
        self.tpot = OnlineLinearModel(_TPOT_SCALE, horizon=horizon)


class LatencyModel:
    """Per-replica TTFT/TPOT models, a pooled fleet model as their prior, bounded in replicas."""

    def __init__(
        self,
        detector: SaturationDetector,
        *,
        horizon: int = 500,
        min_samples: int = 20,
        max_replicas: int = 4096,
        training_per_s: float = 100.0,
    ) -> None:
        self._detector = detector
        self._horizon = horizon
        self.min_samples = min_samples
        self._max_replicas = max_replicas
        self._training_per_s = training_per_s
        self._fleet_budget = _TrainingBudget(training_per_s, time.monotonic())
        self._budgets: OrderedDict[str, _TrainingBudget] = OrderedDict()
        self.fleet = _Replica(horizon)
        self.fleet.ttft.set_prior(_TTFT_PRIOR)
        self.fleet.tpot.set_prior(_TPOT_PRIOR)
        self._replicas: OrderedDict[str, _Replica] = OrderedDict()
        self._bias: dict[str, float] = {}  # priority → mean observed / predicted TTFT

    def reconfigure(self, *, horizon: int, min_samples: int, training_per_s: float = 100.0) -> None:
        """Hot reload: the new memory applies to every model from its next observation."""
        self._horizon, self.min_samples = horizon, min_samples
        if training_per_s != self._training_per_s:  # full buckets at the new rate
            self._training_per_s = training_per_s
            self._fleet_budget = _TrainingBudget(training_per_s, time.monotonic())
            self._budgets.clear()
        for replica in (self.fleet, *self._replicas.values()):
            replica.ttft.set_horizon(horizon)
            replica.tpot.set_horizon(horizon)

    # -- features ---------------------------------------------------------------------
    def ttft_features(self, endpoint: Endpoint, uncached_tokens: float) -> tuple[float, ...]:
        detector = self._detector
        queued = detector.estimated_waiting(endpoint)
        if queued is None:
            capacity = detector.capacity(endpoint)
            queued = max(0, endpoint.in_flight - capacity) if capacity else 0.0
        kv = detector.estimated_kv_usage(endpoint) or 0.0
        prefill = uncached_tokens + endpoint.pending_prefill_tokens
        return (1.0, prefill, float(queued), float(endpoint.in_flight), min(1.5, kv))

    def tpot_features(self, endpoint: Endpoint) -> tuple[float, ...]:
        kv = self._detector.estimated_kv_usage(endpoint) or 0.0
        return (1.0, float(endpoint.in_flight), min(1.5, kv))

    # -- predictions --------------------------------------------------------------------
    def _for(self, name: str) -> _Replica:
        replica = self._replicas.get(name)
        return replica if replica is not None else self.fleet

    def predict_ttft(self, endpoint: Endpoint, uncached_tokens: float, priority: str | None = None) -> float:
        """Milliseconds from now to this request's first token on ``endpoint`` (for its class)."""
        predicted = self._for(endpoint.name).ttft.predict(self.ttft_features(endpoint, uncached_tokens))
        return predicted * self._bias.get(priority, 1.0) if priority is not None else predicted

    def class_bias(self, priority: str) -> float:
        return self._bias.get(priority, 1.0)

    def predict_tpot(self, endpoint: Endpoint) -> float:
        return self._for(endpoint.name).tpot.predict(self.tpot_features(endpoint))

    def confident(self, endpoint: Endpoint) -> bool:
        """Whether the prediction for ``endpoint`` rests on enough observations to act on."""
        replica = self._replicas.get(endpoint.name)
        own = replica.ttft.samples if replica is not None else 0
        return own >= self.min_samples or (own > 0 and self.fleet.ttft.samples >= 2 * self.min_samples)

    def samples(self, name: str) -> int:
        replica = self._replicas.get(name)
        return replica.ttft.samples if replica is not None else 0

    def coefficients(self, name: str | None = None) -> dict[str, dict[str, float]]:
        """The current fit (a replica's, or the fleet's with None), by feature name: for tests and ops."""
        replica = self.fleet if name is None else self._for(name)
        return {
            "ttft": dict(zip(TTFT_FEATURES, replica.ttft.theta, strict=True)),
            "tpot": dict(zip(TPOT_FEATURES, replica.tpot.theta, strict=True)),
        }

    # -- learning -----------------------------------------------------------------------
    def training(self, name: str, *, always: bool = False) -> Training | None:
        """Whether an answer from replica ``name`` sent now will train a model, and which: each
        model takes at most ``training_per_s`` answers a second (``always``: every model, for a
        debug request whose predicted TTFT is reported); None: neither, skip the sample."""
        if always:
            return _BOTH
        now = time.monotonic()
        rate = self._training_per_s
        budget = self._budgets.get(name)
        if budget is None:
            budget = self._budgets[name] = _TrainingBudget(rate, now)
            while len(self._budgets) > self._max_replicas:
                self._budgets.popitem(last=False)
        replica = budget.take(rate, now)
        fleet = self._fleet_budget.take(rate, now)
        if replica and fleet:
            return _BOTH
        return _TRAININGS[replica, fleet] if replica or fleet else None

    def sample(self, endpoint: Endpoint, uncached_tokens: float, training: Training = _BOTH) -> LatencySample:
        """The features of an attempt about to be sent, and what the model expects of it."""
        ttft_x = self.ttft_features(endpoint, uncached_tokens)
        predicted = self._for(endpoint.name).ttft.predict(ttft_x)
        tpot_x = self.tpot_features(endpoint)
        return LatencySample(endpoint.name, ttft_x, tpot_x, predicted, time.monotonic(), training)

    def _replica(self, name: str) -> _Replica:
        replica = self._replicas.get(name)
        if replica is None:
            replica = self._replicas[name] = _Replica(self._horizon)
            replica.ttft.set_prior(self.fleet.ttft.theta)
            replica.tpot.set_prior(self.fleet.tpot.theta)
            while len(self._replicas) > self._max_replicas:
                self._replicas.popitem(last=False)
        else:
            self._replicas.move_to_end(name)
        return replica

    def observe_ttft(
        self,
        name: str,
        x: Sequence[float],
        ttft_ms: float,
        *,
        priority: str | None = None,
        predicted_ms: float | None = None,
        training: Training = _BOTH,
    ) -> None:
        if priority is not None and predicted_ms:
            bias = self._bias.get(priority, 1.0)
            self._bias[priority] = bias + 0.05 * (min(10.0, max(0.1, ttft_ms / predicted_ms)) - bias)
        if training.fleet:
            self.fleet.ttft.observe(x, ttft_ms, _TTFT_PRIOR)
        if training.replica:
            self._replica(name).ttft.observe(x, ttft_ms, self.fleet.ttft.theta)

    def observe_tpot(self, name: str, x: Sequence[float], tpot_ms: float, training: Training = _BOTH) -> None:
        if training.fleet:
            self.fleet.tpot.observe(x, tpot_ms, _TPOT_PRIOR)
        if training.replica:
            self._replica(name).tpot.observe(x, tpot_ms, self.fleet.tpot.theta)

    def forget(self, name: str) -> None:
        """The replica left the fleet (or restarted): its history says nothing any more."""
        self._replicas.pop(name, None)
        self._budgets.pop(name, None)
