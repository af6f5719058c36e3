"""When did attempts to an endpoint stop? Ejection accounting over attempt times (seconds)."""

from __future__ import annotations

__all__ = ["dedupe_times", "ejection_times"]


def dedupe_times(times: list[float], window_s: float) -> list[float]:
    """Sorted ``times`` with every time within ``window_s`` of the previously kept one dropped."""
    kept: list[float] = []
    for t in sorted(times):
        if not kept or t - kept[-1] > window_s:
            kept.append(t)
    return kept


def _sparse(times: list[float], start: float, end: float, gap_s: float, burst: int = 2) -> bool:
    """Attempts after ``start`` look like probes: ``gap_s`` apart on average, never more than
    ``burst`` within one ``gap_s`` window."""
    if times and (end - start) / len(times) < gap_s:
        return False
    return all(j + burst >= len(times) or times[j + burst] - t >= gap_s for j, t in enumerate(times))


def ejection_times(
    events: list[float], inject_at: float, load_end: float, gap_s: float
) -> tuple[float, float | None, int]:
    """(last_sent_s, ejected_after_s, attempts after ejection) from attempt times (seconds).

    Ejected at the first point after ``inject_at`` (injection itself or an attempt) that is
    followed by ``gap_s`` of silence *and* after which attempts stay probe-like (see
    :func:`_sparse`): a breaker's half-open probes do not undo an ejection, while a
    replica that merely gets little traffic is not called ejected at its first lull.
    None if no such point exists before ``load_end``.
    """
    after = sorted(t for t in events if t >= inject_at)
    if not after:
        return 0.0, 0.0, 0
    points = [inject_at, *after]
    end = max(load_end, points[-1])
    for i, t in enumerate(points):
        rest = points[i + 1 :]
        nxt = rest[0] if rest else end
        if nxt - t >= gap_s and _sparse(rest, t, end, gap_s):
            return after[-1] - inject_at, t - inject_at, len(rest)
    return after[-1] - inject_at, None, 0
