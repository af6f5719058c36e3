"""SLO benchmark: attainment, goodput, TTFT p99 and shed rate per class, default policy vs SLO-aware.

    python -m loadtest.slo_bench [--duration 12] [--loads 0.8,1.5,3]

Four simulated replicas with 2 batch slots (as ``loadtest.burst``), vLLM's priority
scheduling on. Four request classes with their own TTFT objective, mixed in one stream:

| class | x-priority | TTFT SLO | share |
|---|---|---:|---:|
| critical | critical | 500 ms | 15 % |
| interactive | standard | 400 ms | 35 % |
| batch | standard | 4,000 ms | 20 % |
| sheddable | sheddable | 1,000 ms | 30 % |

Prompts of 100–700 tokens, half of them behind one of 8 shared 600-token system prompts
(so prefix hits matter), 16–64 output tokens. Fleet capacity is measured first (closed
loop, same mix); then, for each load (× capacity), two runs on a fresh fleet each:

- ``default``: the default preset (prefix-aware), no SLO headers — today's gateway;
- ``slo-aware``: the ``slo-aware`` preset, every request with its ``x-slo-ttft-ms``, and
  ``admission.slo.drop_overdue`` (a queued request whose deadline passed is refused, not
  served late);
- ``sglang-router``: ``sglang-router`` (PyPI) with ``cache_aware`` in front of the same
  replicas (no admission control), when its venv is there (``loadtest/peers.py``).

Both are judged against the same objectives: a request *meets* its SLO when it succeeded
with TTFT ≤ its class's objective; a 429 is a miss. Goodput = requests meeting their SLO
per second of arrivals. Plus the step burst from idle (150 at once on two 2-slot replicas,
as ``tests/admission/test_burst_from_idle.py``) as its own row, both policies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loadtest.harness.fleet import start_gateway, start_replicas, stop_all
from loadtest.report import percentile
from loadtest.runner import BenchResult, DirectRoundRobinTarget, GatewayTarget, run_benchmark
from loadtest.workloads import WorkItem, Workload, pseudo_text

__all__ = ["CLASSES", "SloMixWorkload", "main"]

# class → (x-priority, TTFT objective ms, share)
CLASSES: dict[str, tuple[str, float, float]] = {
    "critical": ("critical", 500.0, 0.15),
    "interactive": ("standard", 400.0, 0.35),
    "batch": ("standard", 4000.0, 0.20),
    "sheddable": ("sheddable", 1000.0, 0.30),
}
MODEL = "sim-llama"


class SloMixWorkload(Workload):
    """The class mix above; ``with_slo`` adds each class's ``x-slo-ttft-ms`` header."""

    name = "slo-mix"

    def __init__(self, *, num_requests: int = 512, with_slo: bool = True, **base: Any) -> None:
        super().__init__(**base)
        self.num_requests = num_requests
        self.with_slo = with_slo

    @property
    def total_requests(self) -> int:
        return self.num_requests

    def items(self) -> Iterator[WorkItem]:
        rng = random.Random(f"{self.seed}/slo-mix")
        names = list(CLASSES)
        weights = [CLASSES[n][2] for n in names]
        systems = [pseudo_text(random.Random(f"system/{g}"), 600) for g in range(8)]
        for i in range(self.num_requests):
            cls = rng.choices(names, weights)[0]
            priority, ttft_ms, _ = CLASSES[cls]
            system = systems[rng.randrange(8)] if rng.random() < 0.5 else None
            user = pseudo_text(random.Random(f"{self.seed}/user/{i}"), rng.randint(100, 700))
            body = self._body(rng.randint(16, 64), system=system, user=user)
            headers = {"x-priority": priority}
            if self.with_slo:
                headers["x-slo-ttft-ms"] = f"{ttft_ms:g}"
            yield WorkItem(self.api, body, headers, priority=cls)  # the record carries the class


def _sim_args() -> list[str]:
    return ["--max-num-seqs", "2", "--kv-blocks", "2048", "--scheduling-policy", "priority"]


def _gateway_config(policy: str) -> Path:
    path = Path(tempfile.gettempdir()) / f"llm-gateway-slo-bench-{policy}.yaml"
    text = "admission:\n  queue_timeout_s: 5\n"
    text += "  engine_priority: {critical: -10, standard: 0, sheddable: 10}\n"
    if policy == "slo-aware":
        text += "  slo: {drop_overdue: true}\n"
    path.write_text(text)
    return path


def summarise(results: list[BenchResult], span_s: float) -> dict[str, Any]:
    """Per class and overall: sent, ok, shed, attainment, TTFT p99; goodput over ``span_s``.

    Several rounds of one arm are pooled: a class's p99 over 90 requests of one round is
    its slowest one or two, over five rounds it is a percentile.
    """
    rows: dict[str, Any] = {}
    met_total = shed_total = 0
    pooled = [r for result in results for r in result.records]
    for cls, (_, slo_ms, _) in CLASSES.items():
        records = [r for r in pooled if r.priority == cls]
        ok = [r for r in records if r.ok]
        met = [r for r in ok if r.ttft is not None and r.ttft * 1000 <= slo_ms]
        shed = sum(1 for r in records if r.status == 429)
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        met_total += len(met)
        shed_total += shed
        rows[cls] = {
            "sent": len(records),
            "ok": len(ok),
            "shed": shed,
            "other": len(records) - len(ok) - shed,
            "attainment": round(len(met) / len(records), 3) if records else None,
            "ttft_p50_ms": round((percentile(ttfts, 50) or 0) * 1000),
            "ttft_p99_ms": round((percentile(ttfts, 99) or 0) * 1000),
        }
    sent = len(pooled)
    return {
        "sent": sent,
        "goodput_rps": round(met_total / span_s, 2),
        "attainment": round(met_total / sent, 3) if sent else None,
        "shed_rate": round(shed_total / sent, 3) if sent else None,
        "classes": rows,
    }


def _class_ttfts(results: list[BenchResult], cls: str) -> list[float]:
    return [r.ttft for result in results for r in result.records if r.priority == cls and r.ok and r.ttft]


def p99_ratio(base: list[float], arm: list[float], *, draws: int = 1000, seed: int = 0) -> list[float] | None:
    """``arm``'s TTFT p99 over ``base``'s, with a 90 % bootstrap interval: [ratio, low, high].

    A class's p99 rests on its slowest few requests, so a single ratio says little; the
    interval (requests resampled with replacement within each arm) says whether a
    difference is more than the luck of which requests were slow.
    """
    if len(base) < 20 or len(arm) < 20:
        return None
    rng = random.Random(seed)

    def p99_of_a_resample(ttfts: list[float]) -> float:
        return percentile(rng.choices(ttfts, k=len(ttfts)), 99) or 0

    ratios = sorted(p99_of_a_resample(arm) / (p99_of_a_resample(base) or 1) for _ in range(draws))
    point = (percentile(arm, 99) or 0) / (percentile(base, 99) or 1)
    return [round(point, 3), round(ratios[int(0.05 * draws)], 3), round(ratios[int(0.95 * draws) - 1], 3)]


async def _measure_capacity(duration_s: float) -> float:
    replicas = await start_replicas(4, _sim_args())
    try:
        workload = SloMixWorkload(num_requests=10_000, with_slo=False, model=MODEL, seed=1)
        result = await run_benchmark(
            workload, DirectRoundRobinTarget([r.url for r in replicas]), concurrency=24,
            max_requests=10_000, deadline_s=duration_s, progress=False, name="capacity",
        )  # fmt: skip
        return sum(1 for r in result.records if r.ok) / result.duration_s
    finally:
        await stop_all(replicas)


async def _run(
    policy: str, replicas_n: int, rate: float, count: int, duration_s: float
) -> tuple[BenchResult, float]:
    replicas = await start_replicas(replicas_n, _sim_args())
    procs: list[Any] = list(replicas)
    try:
        urls = [r.url for r in replicas]
        if policy == "sglang-router":
            from loadtest.harness.ports import free_port
            from loadtest.peers import start_peer

            front = await start_peer("sglang-router", free_port(), urls, "cache_aware")
        else:
            preset = "slo-aware" if policy == "slo-aware" else "prefix-aware"
            front = await start_gateway(urls, ["--policy", preset, "--config", str(_gateway_config(policy))])
        procs.append(front)
        workload = SloMixWorkload(num_requests=count, with_slo=policy == "slo-aware", model=MODEL, seed=5)
        result = await run_benchmark(
            workload, GatewayTarget(front.url, label=policy), rate=rate, max_requests=count,
            deadline_s=duration_s + 30, progress=False, name=policy,
        )  # fmt: skip
        span = duration_s if math.isfinite(rate) else result.duration_s
        return result, span
    finally:
        await stop_all(procs)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    capacity = await _measure_capacity(args.capacity_s)
    print(f"fleet capacity: {capacity:.1f} req/s", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"capacity_rps": round(capacity, 2), "duration_s": args.duration, "runs": []}
    loads = [float(x) for x in args.loads.split(",")]
    plan = [(f"{x:g}x", 4, x * capacity, max(1, int(x * capacity * args.duration))) for x in loads]
    plan.append(("burst 150 from idle (2x2 slots)", 2, math.inf, 150))
    from loadtest.peers import peer_available

    policies = args.policies.split(",")
    if "sglang-router" in policies and not peer_available("sglang-router"):
        policies.remove("sglang-router")
    if not args.burst:
        plan.pop()
    out["rounds"] = args.rounds
    for label, replicas_n, rate, count in plan:
        results: dict[str, list[tuple[BenchResult, float]]] = {p: [] for p in policies}
        for round_ in range(args.rounds):  # arms interleaved: the shared host's load drifts
            for policy in policies:
                result, span = await _run(policy, replicas_n, rate, count, args.duration)
                results[policy].append((result, span))
                one = {"load": label, "policy": policy, "round": round_, **summarise([result], span)}
                print(json.dumps(one), file=sys.stderr, flush=True)
        for policy in policies:
            pooled = [r for r, _ in results[policy]]
            row = summarise(pooled, sum(s for _, s in results[policy]))
            row.update(load=label, policy=policy)
            if policy != "default" and "default" in results:
                base = [r for r, _ in results["default"]]
                row["p99_vs_default"] = {
                    c: p99_ratio(_class_ttfts(base, c), _class_ttfts(pooled, c)) for c in CLASSES
                }
            out["runs"].append(row)
    return out


def markdown(out: dict[str, Any]) -> str:
    classes = list(CLASSES)
    head = " | ".join(f"{c} att. / p50 / p99 ms" for c in classes)
    lines = [
        f"fleet capacity (measured): {out['capacity_rps']} req/s; {out['duration_s']:g} s of arrivals a run, "
        f"{out.get('rounds', 1)} round(s) per arm, interleaved, pooled",
        "",
        f"| load | policy | sent | goodput req/s | attainment | shed | {head} |",
        "|---|---|---:|---:|---:|---:|" + "---:|" * len(classes),
    ]
    for row in out["runs"]:
        cells = []
        for c in classes:
            cell = row["classes"][c]
            ttft = f"{cell['ttft_p50_ms']:,} / {cell['ttft_p99_ms']:,}"
            cells.append(f"{cell['attainment']:.2f} / {ttft}" if cell["sent"] else "–")
        lines.append(
            f"| {row['load']} | {row['policy']} | {row['sent']} | {row['goodput_rps']} | "
            f"{row['attainment']:.2f} | {row['shed_rate']:.2f} | " + " | ".join(cells) + " |"
        )
    compared = [row for row in out["runs"] if row.get("p99_vs_default")]
    if compared:
        lines += ["", "TTFT p99 ÷ the default's, same run, [90 % bootstrap interval]:", ""]
        lines += [f"| load | policy | {' | '.join(classes)} |", "|---|---|" + "---:|" * len(classes)]
        for row in compared:
            cells = []
            for c in classes:
                ratio = row["p99_vs_default"][c]
                cells.append(f"{ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}]" if ratio else "–")
            lines.append(f"| {row['load']} | {row['policy']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals per run")
    parser.add_argument("--loads", default="0.8,1.5,3", help="multiples of the measured capacity")
    parser.add_argument("--capacity-s", type=float, default=8.0, help="closed-loop capacity measurement")
    parser.add_argument("--out", default="bench-results/slo")
    parser.add_argument("--no-burst", dest="burst", action="store_false", help="skip the burst rows")
    parser.add_argument("--policies", default="default,slo-aware,sglang-router", help="arms, comma-separated")
    parser.add_argument("--rounds", type=int, default=1, help="runs per arm and load, interleaved and pooled")
    args = parser.parse_args(argv)
    from gateway.http.server import install_uvloop

    install_uvloop()
    out = asyncio.run(run(args))
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "slo.json").write_text(json.dumps(out, indent=1))
    table = markdown(out)
    (path / "slo.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
