"""How well the gateway's learned latency model predicts TTFT: simulator or real vLLM.

    python -m loadtest.latency_fit                       # two simulated replicas
    python -m loadtest.latency_fit --engine vllm         # two real vLLM (CPU build) replicas

Streams chat requests through ``llm-gateway serve --policy slo-aware`` with
``x-gateway-debug: 1``: each answer carries ``x-gateway-predicted-ttft-ms``, the model's
prediction for the replica that served it at the moment it was routed. The client
measures its own TTFT (send → first body byte). Prompts of assorted lengths (half of
them extending one of four shared prefixes, so prefix hits vary) are sent in phases of
1, 3 and 6 concurrent senders (2 replicas × 2 batch slots on the simulator), so queue
and prefill features move. After a warm-up the table gives the model's error against
the observed TTFT, next to a baseline in the same run: the warm-up's mean TTFT as a
constant prediction (what a model without features would say).

``--rounds N`` repeats the run N times on the same replicas, each round with a fresh gateway
(an untrained model), the replicas' prefix caches emptied, and its own warm-up constant; the
table pools the rounds' measured answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.harness.fleet import start_gateway, start_replicas, stop_all
from loadtest.harness.scrape import reset_prefix_caches
from loadtest.workloads import pseudo_text

__all__ = ["main", "summarise"]

SIM_MODEL = "sim-llama"
PHASES = [1, 3, 6]  # concurrent senders per phase: idle, busy, queueing (2 replicas × 2 slots)


def _prompts(count: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    shared = [pseudo_text(random.Random(f"shared/{i}"), max_words // 2) for i in range(4)]
    out = []
    for i in range(count):
        own = pseudo_text(random.Random(f"own/{seed}/{i}"), rng.randint(20, max_words // 2))
        out.append(f"{rng.choice(shared)}\n{own}" if rng.random() < 0.5 else own)
    return out


async def _one(
    http: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int, failed: Counter[str]
) -> tuple[float, float] | None:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True}  # fmt: skip
    started = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json=body, headers={"x-gateway-debug": "1"}) as resp:
        if resp.status != 200:
            failed[f"{resp.status}: {(await resp.text())[:120]}"] += 1
            return None
        predicted = resp.headers.get("x-gateway-predicted-ttft-ms")
        if predicted is None:
            failed["no prediction header"] += 1
        await resp.content.readany()
        ttft_ms = (time.perf_counter() - started) * 1000
        await resp.read()
    return (float(predicted), ttft_ms) if predicted is not None else None


async def _drive(
    url: str, model: str, prompts: list[str], phases: list[int], failed: Counter[str]
) -> list[tuple[float, float]]:
    pairs: list[tuple[float, float]] = []
    rng = random.Random(7)
    per_phase = len(prompts) // len(phases)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for p, senders in enumerate(phases):
            todo = list(prompts[p * per_phase : (p + 1) * per_phase])

            async def sender(queue: list[str]) -> None:
                while queue:
                    result = await _one(http, url, model, queue.pop(), rng.randint(4, 24), failed)
                    if result is not None:
                        pairs.append(result)

            await asyncio.gather(*(sender(todo) for _ in range(senders)))
    return pairs


def measured(pairs: list[tuple[float, float]], warmup: int) -> list[tuple[float, float, float]]:
    """(model's prediction, observed, constant) for the answers after ``warmup``; the constant is
    the warm-up's mean TTFT, what a model without features would have said."""
    warm, rest = pairs[:warmup], pairs[warmup:]
    if not rest:
        return []
    constant = statistics.fmean(o for _, o in warm) if warm else statistics.fmean(o for _, o in rest)
    return [(p, o, constant) for p, o in rest]


def summarise(triples: list[tuple[float, float, float]]) -> dict[str, Any]:
    """The model's error against the observed TTFT, and the constant baseline's, same answers."""
    if not triples:
        return {"measured": 0}

    def errors(predict: list[float]) -> dict[str, float]:
        abs_err = [abs(p - o) for p, (_, o, _) in zip(predict, triples, strict=True)]
        rel = sorted(abs(p - o) / o for p, (_, o, _) in zip(predict, triples, strict=True) if o > 0)
        return {
            "mae_ms": round(statistics.fmean(abs_err), 1),
            "median_rel_err": round(statistics.median(rel), 3),
            "p90_rel_err": round(rel[int(0.9 * (len(rel) - 1))], 3),
        }

    observed = [o for _, o, _ in triples]
    return {
        "measured": len(triples),
        "observed_ttft_ms": {"mean": round(statistics.fmean(observed), 1),
                             "p50": round(statistics.median(observed), 1), "max": round(max(observed), 1)},
        "model": errors([p for p, _, _ in triples]),
        "constant_mean": errors([c for _, _, c in triples]),
    }  # fmt: skip


async def _round(urls: list[str], model: str, prompts: list[str], out_dir: Path) -> dict[str, Any]:
    """A fresh gateway (an untrained model) in front of the fleet, its prefix caches emptied first."""
    async with aiohttp.ClientSession() as http:
        await reset_prefix_caches(http, urls)
    config = out_dir / "gateway.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("scrape: {interval_s: 0.25}\nadmission: {slo: {min_samples: 10}}\n")
    gateway = await start_gateway(urls, ["--policy", "slo-aware", "--config", str(config)])
    try:
        failed: Counter[str] = Counter()
        pairs = await _drive(gateway.url, model, prompts, PHASES, failed)
        return {"answered": len(pairs), "failed": dict(failed), "pairs": pairs}
    finally:
        await stop_all([gateway])


async def run(args: argparse.Namespace) -> dict[str, Any]:
    procs: list[Any] = []
    vllm_replicas: list[Any] = []
    try:
        if args.engine == "vllm":
            from loadtest.realvllm.fleet import MODEL_NAME, ReplicaOptions
            from loadtest.realvllm.fleet import start_replicas as start_vllm

            options = ReplicaOptions(num_blocks=128, block_size=32)
            vllm_replicas = await asyncio.to_thread(start_vllm, 2, options, timeout_s=420)
            # ~4 tiny-llama tokens a word: prompts stay below max_model_len (2,048)
            urls, model, max_words = [r.url for r in vllm_replicas], MODEL_NAME, 240
        else:
            sims = await start_replicas(2, ["--max-num-seqs", "2", "--time-scale", "2"])
            procs += sims
            urls, model, max_words = [s.url for s in sims], SIM_MODEL, 3000
        prompts = _prompts(args.requests, max_words, seed=11)
        triples: list[tuple[float, float, float]] = []
        failed: Counter[str] = Counter()
        for _ in range(args.rounds):
            result = await _round(urls, model, prompts, Path(args.out))
            triples.extend(measured(result["pairs"], args.warmup))
            failed.update(result["failed"])
        return {"engine": args.engine, "sent": args.requests * args.rounds, "rounds": args.rounds,
                "warmup": args.warmup, "failed": dict(failed), **summarise(triples)}  # fmt: skip
    finally:
        await stop_all(procs)
        if vllm_replicas:
            from loadtest.realvllm.fleet import stop_replicas

            await asyncio.to_thread(stop_replicas, vllm_replicas)


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument("--out", default="bench-results/latency-fit")
    parser.add_argument("--rounds", type=int, default=1, help="fresh gateways on the same replicas")
    args = parser.parse_args(argv)
    out = asyncio.run(run(args))
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{args.engine}.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
