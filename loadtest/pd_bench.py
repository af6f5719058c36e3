"""P/D disaggregation benchmark: 2 prefill + 2 decode replicas vs 4 co-located replicas.

``python -m loadtest.pd_bench [--duration 30] [--rate 4] [--long-tokens 4000-8000]``

Every replica is its own simulator process (time_scale 1 by default) and the gateway is
``llm-gateway serve`` in its own process. The workload mixes, open-loop Poisson:

- **long-prompt** requests (``--long-tokens`` prompt, short output): prefill-heavy;
- **decode-heavy** requests (short prompt, ``--decode-out`` output tokens): ongoing decodes.

In a co-located fleet a long prefill stalls the decode steps of every request batched
with it (ITL spikes); with P/D the decode replicas only ever run decode steps. Reported
per setup and request class: TTFT p50/p99 and ITL p99, plus the decode replicas'
honoured/recomputed KV-transfer counters and the replicas' step wall/model ratio (>1.1
means this machine could not keep up and the numbers are inflated).

Writes ``bench-results/pd/pd-bench-<time>.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.harness.fleet import ManagedProcess, start_gateway, start_replicas, stop_all
from loadtest.report import percentile
from loadtest.runner import BenchResult, GatewayTarget, run_benchmark
from loadtest.workloads import WorkItem, Workload, pseudo_text

__all__ = ["MixedPDWorkload", "main"]

LONG, DECODE = 0, 1  # WorkItem.group: the request class
CLASS_NAMES = {LONG: "long-prompt", DECODE: "decode-heavy"}
MODEL = "sim-llama"


class MixedPDWorkload(Workload):
    """Single-shot requests: a `long_share` of long prompts, the rest short prompts with long outputs."""

    name = "pd-mixed"

    def __init__(
        self,
        *,
        requests: int = 120,
        long_share: float = 0.3,
        long_tokens: tuple[int, int] = (4000, 8000),
        long_out: int = 16,
        decode_tokens: tuple[int, int] = (100, 400),
        decode_out: int = 256,
        model: str = MODEL,
        seed: int = 0,
    ) -> None:
        super().__init__(model=model, seed=seed)
        self.requests = requests
        self.long_share = long_share
        self.long_tokens = long_tokens
        self.long_out = long_out
        self.decode_tokens = decode_tokens
        self.decode_out = decode_out

    @property
    def total_requests(self) -> int:
        return self.requests

    def params(self) -> dict[str, Any]:
        keys = ("requests", "long_share", "long_tokens", "long_out", "decode_tokens", "decode_out", "seed")
        return {k: getattr(self, k) for k in keys}

    def items(self) -> Iterator[WorkItem]:
        rng = random.Random(f"{self.seed}/pd-mixed")
        for i in range(self.requests):
            if rng.random() < self.long_share:
                group, n, out = LONG, rng.randint(*self.long_tokens), self.long_out
            else:
                group, n, out = DECODE, rng.randint(*self.decode_tokens), self.decode_out
            # A unique head keeps prompts from sharing cached prefixes across requests.
            user = f"r{i} " + pseudo_text(rng, n)
            yield WorkItem(kind="chat", body=self._body(out, system=None, user=user), group=group)


# --------------------------------------------------------------------------- fleet


def _yaml_config(prefills: list[str], decodes: list[str], decider: str) -> str:
    lines = ["endpoints:"]
    lines += [f"  - url: {u}\n    role: prefill" for u in prefills]
    lines += [f"  - url: {u}\n    role: decode" for u in decodes]
    lines += ["pd:", "  protocol: vllm", f"  decider: {decider}", "log_level: warning"]
    return "\n".join(lines) + "\n"


async def _state(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/admin/state") as r:
        return dict(await r.json())


async def _gateway_pd_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("llm_gateway_pd_decisions_total", "llm_gateway_pd_degraded_total")):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def run_setup(
    label: str, args: argparse.Namespace, workload: MixedPDWorkload, log_dir: Path
) -> dict[str, Any]:
    sim_args = ["--time-scale", str(args.time_scale)]
    procs: list[ManagedProcess] = []
    try:
        if label == "co-located":
            replicas = await start_replicas(4, sim_args, log_dir=log_dir / label)
            procs += replicas
            prefills, decodes = [], [r.url for r in replicas]
            gw = await start_gateway(decodes, ["--log-level", "warning"], log_dir=log_dir / label)
        else:
            decider = label.removeprefix("pd-")
            pre = await start_replicas(2, [*sim_args, "--role", "prefill"], log_dir=log_dir / label / "p")
            procs += pre
            dec = await start_replicas(2, [*sim_args, "--role", "decode"], log_dir=log_dir / label / "d")
            procs += dec
            prefills, decodes = [r.url for r in pre], [r.url for r in dec]
            cfg = log_dir / f"{label}.yaml"
            cfg.write_text(_yaml_config(prefills, decodes, decider))
            gw = await start_gateway([], ["--config", str(cfg)], log_dir=log_dir / label)
        procs.append(gw)
        await asyncio.sleep(1.0)  # first health checks and scrapes
        result: BenchResult = await run_benchmark(
            workload,
            GatewayTarget(gw.url, label),
            rate=args.rate,
            max_requests=workload.total_requests,
            deadline_s=args.duration + 120,
            replica_urls=[*prefills, *decodes],
            progress=False,
            name=label,
        )
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            states = {u: await _state(s, u) for u in [*prefills, *decodes]}
            gw_pd = await _gateway_pd_metrics(s, gw.url)
    finally:
        await stop_all(procs)
    return _summarize(label, result, states, decodes, gw_pd)


def _summarize(
    label: str,
    result: BenchResult,
    states: dict[str, dict[str, Any]],
    decodes: list[str],
    gw_pd: dict[str, float],
) -> dict[str, Any]:
    classes: dict[str, Any] = {}
    for group, cname in CLASS_NAMES.items():
        recs = [r for r in result.records if r.group == group]
        ok = [r for r in recs if r.ok]
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        itls = [x for r in ok for x in r.itls]
        classes[cname] = {
            "requests": len(recs),
            "ok": len(ok),
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "itl_p50_s": percentile(itls, 50),
            "itl_p99_s": percentile(itls, 99),
            "cached_tokens_share": (
                sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)) if ok else None
            ),
        }
    honoured = sum(states[u]["pd_transfers"]["honoured"] for u in decodes)
    recomputed = sum(states[u]["pd_transfers"]["recomputed"] for u in decodes)
    ratio = max(s["step_wall_over_model_total"] for s in states.values())
    return {
        "setup": label,
        "duration_s": result.duration_s,
        "stopped_by": result.stopped_by,
        "classes": classes,
        "decode_pd_transfers": {"honoured": honoured, "recomputed": recomputed},
        "max_step_wall_over_model": ratio,
        "gateway_pd_metrics": gw_pd,
        "replicas": {
            u: {k: s[k] for k in ("role", "finished", "pd_transfers", "steps")} for u, s in states.items()
        },
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    out = [
        "| setup | class | ok/n | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms"
        " | decode honoured/recomputed | step wall/model |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        pd = row["decode_pd_transfers"]
        for cname, c in row["classes"].items():
            out.append(
                f"| {row['setup']} | {cname} | {c['ok']}/{c['requests']} | {_ms(c['ttft_p50_s'])}"
                f" | {_ms(c['ttft_p99_s'])} | {_ms(c['itl_p50_s'])} | {_ms(c['itl_p99_s'])}"
                f" | {pd['honoured']}/{pd['recomputed']} | {row['max_step_wall_over_model']:.2f} |"
            )
    return "\n".join(out)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.pd_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per setup")
    p.add_argument("--rate", type=float, default=4.0, help="requests/s, open-loop Poisson")
    p.add_argument("--long-share", type=float, default=0.3)
    p.add_argument("--long-tokens", type=_range, default=(4000, 8000), help="long prompt tokens, LO-HI")
    p.add_argument("--long-out", type=int, default=16)
    p.add_argument(
        "--decode-tokens", type=_range, default=(100, 400), help="decode-heavy prompt tokens, LO-HI"
    )
    p.add_argument("--decode-out", type=int, default=256)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument(
        "--setups",
        default="co-located,pd-always,pd-prefix-aware",
        help="comma-separated: co-located, pd-always, pd-prefix-aware, pd-never",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/pd")
    return p


async def amain(args: argparse.Namespace) -> int:
    workload_kw = dict(
        requests=max(1, round(args.rate * args.duration)),
        long_share=args.long_share,
        long_tokens=args.long_tokens,
        long_out=args.long_out,
        decode_tokens=args.decode_tokens,
        decode_out=args.decode_out,
        seed=args.seed,
    )
    log_dir = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    rows = []
    for label in [s.strip() for s in args.setups.split(",") if s.strip()]:
        print(f"running {label} ...", file=sys.stderr, flush=True)
        rows.append(await run_setup(label, args, MixedPDWorkload(**workload_kw), log_dir))
    table = markdown(rows)
    print(table)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"pd-bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    params = {k: v for k, v in vars(args).items()}
    path.write_text(json.dumps({"params": params, "results": rows, "table": table}, indent=2, default=str))
    print(f"\nwrote {path} (process logs in {log_dir})", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
