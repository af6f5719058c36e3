"""Latency objectives per request: ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``, else the defaults.

A header value is a positive number of milliseconds (at most one hour); anything else
is a 400 naming the header, like a bad ``x-priority``. A request with neither header
gets its tenant's objectives (``slo_ttft_ms`` / ``slo_tpot_ms`` in the keys file), else
its priority's defaults (``admission.slo.defaults``), and one with no objective at all
gets ``None``: it is routed and admitted exactly as before SLOs existed.

With auth on, the objectives are settled again once the tenant is known
(:func:`parse_slo` with ``tenant_objectives``): the tenant may bring its own, and its
priority — which may differ from the header's — picks the class defaults.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.errors import BadRequest
from gateway.request.types import Priority, Slo

__all__ = ["MAX_SLO_MS", "SloOptions", "parse_slo"]

MAX_SLO_MS = 3_600_000.0


@dataclass(frozen=True, slots=True)
class SloOptions:
    """Header names and the per-class defaults: priority → (TTFT ms, TPOT ms), either may be None."""

    ttft_header: str = "x-slo-ttft-ms"
    tpot_header: str = "x-slo-tpot-ms"
    defaults: Mapping[Priority, tuple[float | None, float | None]] = field(default_factory=dict)


# ASCII decimal only: Python's float() also reads "١٢٣", "１００", "1_000" and a leading no-break space.
_NUMBER = re.compile(r"\+?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _milliseconds(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    getall = getattr(headers, "getall", None)
    if getall is not None and len(getall(name)) > 1:  # a single value, not a list (RFC 9110 §5.3)
        raise BadRequest(f"header {name}: sent more than once", param=name)
    text = raw.strip(" \t")
    value = float(text) if _NUMBER.fullmatch(text) else math.nan
    if not math.isfinite(value) or value <= 0 or value > MAX_SLO_MS:
        raise BadRequest(
            f"header {name}: {raw[:40]!r} is not a number of milliseconds in (0, {MAX_SLO_MS:g}]",
            param=name,
        )
    return value


def parse_slo(
    headers: Mapping[str, str],
    priority: Priority,
    options: SloOptions,
    now: float | None = None,
    tenant_objectives: tuple[float | None, float | None] = (None, None),
) -> Slo | None:
    """Headers first, then the tenant's objectives, then the class defaults (each as a pair)."""
    ttft = _milliseconds(headers, options.ttft_header)
    tpot = _milliseconds(headers, options.tpot_header)
    if ttft is None and tpot is None:
        ttft, tpot = tenant_objectives
    if ttft is None and tpot is None:
        ttft, tpot = options.defaults.get(priority, (None, None))
    if ttft is None and tpot is None:
        return None
    if now is None:
        now = time.monotonic()
    return Slo(ttft, tpot, None if ttft is None else now + ttft / 1000)
