"""Soak: does the gateway process's memory stay flat under long mixed load?

    python -m loadtest.soak [--duration 600] [--rate 40] [--sample-every 10] [--json out.json] [--png out.png]

One gateway process (``session-aware`` policy, so the prefix index and the session
store are both on the hot path) in front of 4 simulated replicas, and open-loop mixed
load from :class:`loadtest.mix.MixedWorkload`: chat and text completions, streaming and not,
16 shared system prompts, multi-turn conversations under ``x-session-id`` (a fixed pool,
restarted every few turns) and ``x-priority`` classes. The gateway's resident set
(``VmRSS`` in ``/proc/PID/status``) is sampled every ``--sample-every`` seconds.

The first fifth of the run is warm-up (indexes and pools fill up to their bounds); the
verdict compares the RSS at the end of warm-up with the RSS at the end: growth under
10 % is the target.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtest.faults import MODEL, SIM_ARGS, client_lag_ms
from loadtest.harness.fleet import ManagedProcess, start_gateway, start_replicas, stop_all
from loadtest.harness.processes import log_dir as make_log_dir
from loadtest.harness.procfs import rss_kib as read_rss_kib
from loadtest.harness.steady import run_load
from loadtest.mix import MixedWorkload
from loadtest.report import percentile

__all__ = ["TARGET_GROWTH_PCT", "RssSampler", "SoakOptions", "main", "read_rss_kib", "run_soak"]

TARGET_GROWTH_PCT = 10.0


class RssSampler:
    """Samples one process's RSS on a fixed period; times relative to ``t0`` (perf_counter)."""

    def __init__(self, pid: int, t0: float, every_s: float) -> None:
        if every_s <= 0:
            raise ValueError("every_s must be > 0")
        self.pid = pid
        self.t0 = t0
        self.every_s = every_s
        self.samples: list[tuple[float, int]] = []  # (seconds, KiB)

    def sample(self) -> int | None:
        rss = read_rss_kib(self.pid)
        if rss is not None:
            self.samples.append((round(time.perf_counter() - self.t0, 3), rss))
        return rss

    async def run(self) -> None:
        """Sample at t0, t0 + every_s, ... until cancelled (no drift: the schedule is absolute)."""
        tick = 0
        while True:
            await asyncio.sleep(max(0.0, self.t0 + tick * self.every_s - time.perf_counter()))
            self.sample()
            tick += 1


@dataclass
class SoakOptions:
    duration_s: float = 600.0
    rate: float = 40.0
    sample_every_s: float = 10.0
    replicas: int = 4
    request_timeout_s: float = 30.0
    policy: str = "session-aware"
    warmup_fraction: float = 0.2
    seed: int = 0
    log_dir: Path | None = None


def _mix(seed: int) -> MixedWorkload:
    return MixedWorkload(
        model=MODEL,
        seed=seed,
        stream_share=0.5,
        completion_share=0.25,
        session_share=0.35,
        priority_share=0.5,
        prefix_groups=16,
        sessions=64,
        max_turns=6,
    )


async def run_soak(opts: SoakOptions) -> dict[str, Any]:
    """Run the soak on a fresh fleet; returns the report (RSS samples included)."""
    log_dir = make_log_dir(opts.log_dir, prefix="llm-gateway-soak-")
    procs: list[ManagedProcess] = []
    try:
        replicas = await start_replicas(opts.replicas, SIM_ARGS, log_dir=log_dir)
        procs += replicas
        config = log_dir / "gateway-soak.yaml"
        config.write_text("server: {drain_s: 0}\n")  # stopping needs no graceful drain
        args = ["--policy", opts.policy, "--config", str(config)]
        gateway = await start_gateway([r.url for r in replicas], args, log_dir=log_dir)
        procs.append(gateway)
        t0 = time.perf_counter()
        sampler = RssSampler(gateway.process.pid, t0, opts.sample_every_s)
        sampling = asyncio.create_task(sampler.run())
        try:
            run = await run_load(
                gateway.url,
                _mix(opts.seed),
                rate=opts.rate,
                duration_s=opts.duration_s,
                request_timeout_s=opts.request_timeout_s,
                seed=opts.seed,
                t0=t0,
            )
        finally:
            sampling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampling
        sampler.sample()  # the end of the run, before the gateway stops
        if gateway.process.returncode is not None:
            raise RuntimeError(f"gateway exited during the soak:\n{gateway.log_tail()}")
    finally:
        await stop_all(procs)
    return _analyse(opts, gateway.process.pid, sampler.samples, run.records)


def _analyse(
    opts: SoakOptions, pid: int, samples: list[tuple[float, int]], records: list[Any]
) -> dict[str, Any]:
    if not samples:
        raise RuntimeError(f"no RSS sample could be read from pid {pid}")
    warm_end = opts.duration_s * opts.warmup_fraction
    warm = next(((t, kib) for t, kib in samples if t >= warm_end), samples[-1])
    end = samples[-1]
    growth = (end[1] - warm[1]) / warm[1] * 100
    ok = [r for r in records if r.ok]
    latencies = [r.latency for r in ok if r.latency is not None]
    return {
        "options": {**asdict(opts), "log_dir": str(opts.log_dir)},
        "gateway_pid": pid,
        "samples": [{"t_s": t, "rss_kib": kib} for t, kib in samples],
        "warmup_end_s": warm_end,
        "rss_after_warmup_kib": warm[1],
        "rss_after_warmup_at_s": warm[0],
        "rss_end_kib": end[1],
        "rss_peak_kib": max(kib for _, kib in samples),
        "growth_pct": round(growth, 2),
        "requests": len(records),
        "served": len(ok),
        "errors": len(records) - len(ok),
        "errors_by_reason": dict(sorted(Counter(r.outcome for r in records if not r.ok).items())),
        "by_kind": dict(
            sorted(Counter(f"{r.kind}/{'stream' if r.stream else 'plain'}" for r in records).items())
        ),
        "e2e_ms": {q: _ms(percentile(latencies, p)) for q, p in (("p50", 50), ("p99", 99))},
        "client_send_lag_ms": client_lag_ms(records),
        "target_met": growth < TARGET_GROWTH_PCT,
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def print_report(report: dict[str, Any], console: Any = None) -> None:
    """The RSS curve and the verdict as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    curve = Table(title=f"gateway RSS (pid {report['gateway_pid']})")
    curve.add_column("t (s)", justify="right")
    curve.add_column("RSS (MiB)", justify="right")
    for s in report["samples"]:
        curve.add_row(f"{s['t_s']:.0f}", f"{s['rss_kib'] / 1024:.1f}")
    console.print(curve)
    summary = Table(title="llm-gateway soak")
    summary.add_column("metric", style="bold")
    summary.add_column("value", justify="right")
    rows = [
        (
            "RSS after warm-up (MiB)",
            f"{report['rss_after_warmup_kib'] / 1024:.1f} at {report['rss_after_warmup_at_s']:.0f}s",
        ),
        ("RSS at the end (MiB)", f"{report['rss_end_kib'] / 1024:.1f}"),
        ("RSS peak (MiB)", f"{report['rss_peak_kib'] / 1024:.1f}"),
        ("growth after warm-up", f"{report['growth_pct']:+.2f} %"),
        ("requests served / sent", f"{report['served']} / {report['requests']}"),
        ("errors", ", ".join(f"{k}:{v}" for k, v in report["errors_by_reason"].items()) or "0"),
        ("E2E p50 / p99 (ms)", f"{report['e2e_ms']['p50']} / {report['e2e_ms']['p99']}"),
        ("client send lag p99 / max (ms)", "{p99} / {max}".format(**report["client_send_lag_ms"])),
        (f"target: growth < {TARGET_GROWTH_PCT:g} %", "yes" if report["target_met"] else "NO"),
    ]
    for label, value in rows:
        summary.add_row(label, value)
    console.print(summary)


def plot_rss(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [s["t_s"] for s in report["samples"]]
    mib = [s["rss_kib"] / 1024 for s in report["samples"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ts, mib, marker=".")
    ax.axvline(report["warmup_end_s"], color="grey", linestyle="--", label="end of warm-up")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("gateway RSS (MiB)")
    ax.set_title(f"soak: growth after warm-up {report['growth_pct']:+.1f} %")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--rate", type=float, default=40.0, help="new requests per second (Poisson)")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS samples")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--policy", default="session-aware")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--png", type=Path, help="plot the RSS curve here")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the growth target is missed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path)
    args = parser.parse_args(argv)
    opts = SoakOptions(
        duration_s=args.duration,
        rate=args.rate,
        sample_every_s=args.sample_every,
        replicas=args.replicas,
        policy=args.policy,
        seed=args.seed,
        log_dir=args.log_dir,
    )
    from gateway.http.server import install_uvloop

    install_uvloop()
    report = asyncio.run(run_soak(opts))
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    if args.png:
        print(f"plot: {plot_rss(report, args.png)}")
    return 1 if args.strict and not report["target_met"] else 0


if __name__ == "__main__":
    sys.exit(main())
