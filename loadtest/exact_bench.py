"""Exact (KV events) vs approximate vs round-robin routing, same workload, same run.

    .venv/bin/python -m loadtest.exact_bench [--replicas 3] [--kv-blocks 256] [--requests 600]
    .venv/bin/python -m loadtest.exact_bench --tokenizer tiny-markers \\
        --arms exact,exact-local,approximate,round-robin --requests 200 --rounds 2

Each arm gets fresh simulator processes (``--kv-events``: vLLM's ZMQ KV events) and its
own ``llm-gateway serve``. The workload is multi-turn chat over shared documents with Zipf
popularity, sized so that its working set is ~1.5× the fleet's KV cache (blocks are
evicted all the time). Reported per arm: the engines' own prefix-cache hit ratio
(``vllm:prefix_cache_hits / queries``), client TTFT p50/p99 (streamed), and the mean
|predicted − engine-reported| cached tokens (``x-gateway-predicted-cached-tokens`` with
``x-gateway-debug: 1`` against ``usage.prompt_tokens_details.cached_tokens``).

``--engine vllm`` runs every arm against the same real vLLM 0.32 (CPU build) replicas
(``loadtest/realvllm``: KV events on, ``--kv-blocks`` blocks of 32 tokens each, the tiny
Llama with its own tokenizer, the workload in its vocabulary): started once, their prefix
caches reset before each arm (vLLM's dev-mode ``POST /reset_prefix_cache``; the reset's
``AllBlocksCleared`` also clears the next gateway's index), hits counted as deltas.
``exact-local`` then tokenizes with the served model's own ``tokenizer.json``.

``--tokenizer DIR`` (``tiny``: the tiny Llama's, built here) makes every arm's simulators
tokenize with that real ``tokenizer.json`` + chat template (``LLMGW_SIM_TOKENIZER``) and the
workload use words of its vocabulary; the ``exact-local`` arm then computes the engine's tokens
in the gateway (``prefix.kv_events.tokenizer``: ``auto`` with that directory, checked against
``/tokenize`` on its first 3 requests) instead of asking ``/tokenize`` per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.harness.fleet import start_gateway, start_replicas, stop_all
from loadtest.harness.scrape import fetch_metrics, reset_prefix_caches
from loadtest.realvllm.model import _WORDS, build_tokenizer

MODEL = "sim-llama"
ARMS = {
    "exact": (
        "prefix-aware",
        {"prefix": {"exact": "auto", "kv_events": {"tokenizer": {"source": "engine"}}}},
    ),
    # the engine's tokens computed in the gateway (needs --tokenizer: the engines tokenize the same way)
    "exact-local": (
        "prefix-aware",
        {"prefix": {"exact": "auto", "kv_events": {"tokenizer": {"path": None}}}},
    ),
    # next turns matched on the previous turn's tokens, /tokenize in the background
    "exact-reuse-turns": (
        "prefix-aware",
        {"prefix": {"exact": "auto", "kv_events": {"reuse_turn_tokens": True}}},
    ),
    "approximate": ("prefix-aware", {"prefix": {"exact": "off"}}),
    "round-robin": ("round-robin", {"prefix": {"exact": "off"}}),
}


def metric_value(text: str, sample: str) -> float | None:
    """The sum of the samples named ``sample`` in a Prometheus text page (None: not there)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.split("{")[0].split(" ")[0] == sample
    ]
    return sum(values) if values else None


@dataclass
class Workload:
    """Documents (Zipf popularity) and conversations over them; the same seed, the same requests."""

    docs: int
    doc_tokens: int
    active: int
    seed: int = 1
    natural: bool = False  # words of the tiny Llama's vocabulary (about a token each), not d3w17-style ids
    rng: random.Random = field(init=False)
    conversations: list[list[dict[str, str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        weights = [1 / (rank + 1) ** 1.1 for rank in range(self.docs)]
        self.weights = [w / sum(weights) for w in weights]

    def document(self, index: int) -> str:
        if self.natural:
            rng = random.Random(index)
            return f"Document {index}: " + " ".join(rng.choice(_WORDS) for _ in range(self.doc_tokens))
        return f"Document {index}: " + " ".join(f"d{index}w{i}" for i in range(self.doc_tokens))

    def question(self, turn: int) -> str:
        count = self.rng.randint(20, 80)
        if self.natural:
            return f"question {turn}: " + " ".join(self.rng.choice(_WORDS) for _ in range(count))
        return f"q{turn} " + " ".join(f"u{turn}x{i}" for i in range(count))

    def next(self, turn: int) -> tuple[int, list[dict[str, str]]]:
        if len(self.conversations) < self.active or self.rng.random() < 0.25:
            doc = self.rng.choices(range(self.docs), self.weights)[0]
            conversation = [{"role": "system", "content": self.document(doc)}]
            if len(self.conversations) >= self.active:
                self.conversations.pop(self.rng.randrange(len(self.conversations)))
            self.conversations.append(conversation)
        index = self.rng.randrange(len(self.conversations))
        conversation = self.conversations[index]
        conversation.append({"role": "user", "content": self.question(turn)})
        return index, list(conversation)


@dataclass
class Result:
    ttft: float
    predicted: int
    cached: int
    endpoint: str = ""


async def one(
    session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], model: str = MODEL
) -> tuple[Result, str]:
    body = {
        "model": model, "messages": messages, "max_tokens": 24, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    ttft, text, usage = None, [], None
    async with session.post(
        url + "/v1/chat/completions", json=body, headers={"x-gateway-debug": "1"}
    ) as resp:
        resp.raise_for_status()
        predicted = int(resp.headers.get("x-gateway-predicted-cached-tokens", "0"))
        endpoint = resp.headers.get("x-gateway-endpoint", "")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    text.append(piece)
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Result(ttft or 0.0, predicted, cached, endpoint), "".join(text)


async def run_arm(
    name: str, args: argparse.Namespace, workdir: Path, fleet: list[str] | None = None
) -> dict[str, Any]:
    """One arm on fresh simulators, or on the running real replicas ``fleet`` (caches reset)."""
    policy, config = ARMS[name]
    if name == "exact-local":
        if not args.tokenizer:
            raise SystemExit("exact-local needs --tokenizer (the engines must tokenize as the gateway)")
        config = {"prefix": {"exact": "auto", "kv_events": {"tokenizer": {"path": args.tokenizer}}}}
    model = args.model
    before = {"hits": 0.0, "queries": 0.0}
    if fleet is None:
        sim_args = ["--kv-events", "--kv-blocks", str(args.kv_blocks), "--time-scale", str(args.time_scale)]
        replicas = await start_replicas(args.replicas, sim_args, log_dir=workdir / name)
        urls = [r.url for r in replicas]
    else:
        replicas, urls = [], fleet
        async with aiohttp.ClientSession() as session:
            await reset_prefix_caches(session, urls)
            for url in urls:
                counters = await fetch_metrics(session, url)
                before["hits"] += counters["hits"]
                before["queries"] += counters["queries"]
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / f"{name}.json"  # JSON is YAML
    config_path.write_text(json.dumps(config))
    gateway = await start_gateway(
        urls, ["--config", str(config_path), "--policy", policy], log_dir=workdir / name
    )
    try:
        await asyncio.sleep(1.5)  # subscribers connect, first scrapes land
        work = Workload(args.docs, args.doc_tokens, args.active, natural=bool(args.tokenizer))
        results: list[Result] = []
        turns = iter(range(args.requests))
        lock = asyncio.Lock()
        busy: set[int] = set()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def worker() -> None:
                for turn in turns:
                    async with lock:
                        index, messages = work.next(turn)
                        while index in busy:  # one request per conversation at a time
                            index, messages = work.next(turn)
                        busy.add(index)
                        conversation = work.conversations[index]
                    try:
                        result, text = await one(session, gateway.url, messages, model)
                    finally:
                        busy.discard(index)
                    conversation.append({"role": "assistant", "content": text})
                    results.append(result)

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            async with session.get(gateway.url + "/metrics") as resp:
                gateway_metrics = await resp.text()
            if args.dump_metrics:
                for line in gateway_metrics.splitlines():
                    if any(k in line for k in args.dump_metrics.split(",")) and not line.startswith("#"):
                        print(name, line)
            hits, queries = -before["hits"], -before["queries"]
            for url in urls:
                counters = await fetch_metrics(session, url)
                hits += counters["hits"]
                queries += counters["queries"]
    finally:
        await stop_all([gateway, *replicas])
    ttfts = sorted(r.ttft for r in results)
    tokenize_s = metric_value(gateway_metrics, "llm_gateway_prefix_tokenize_seconds_sum") or 0.0
    tokenize_n = metric_value(gateway_metrics, "llm_gateway_prefix_tokenize_seconds_count") or 0.0
    local_s = metric_value(gateway_metrics, "llm_gateway_prefix_local_tokenize_seconds_sum") or 0.0
    local_n = metric_value(gateway_metrics, "llm_gateway_prefix_local_tokenize_seconds_count") or 0.0
    shares = sorted(
        (sum(1 for r in results if r.endpoint == e) for e in {r.endpoint for r in results}), reverse=True
    )
    return {
        "tokenize_ms": 1000 * tokenize_s / tokenize_n if tokenize_n else 0.0,
        "tokenize_calls": int(tokenize_n),
        "local_ms": 1000 * local_s / local_n if local_n else 0.0,
        "local_calls": int(local_n),
        "max_share": shares[0] / len(results) if shares else 0.0,
        "arm": name,
        "requests": len(results),
        "hit_ratio": hits / queries if queries else 0.0,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "mean_abs_error_tokens": statistics.fmean(abs(r.predicted - r.cached) for r in results),
        "exact_predictions": sum(1 for r in results if r.predicted == r.cached) / len(results),
    }


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per column, the median over the rounds (the arm's name and request count as they are)."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(r[key] for r in rows)
    out["requests"] = sum(r["requests"] for r in rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--kv-blocks", type=int, default=256, help="per replica, 16 tokens each")
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=700)
    parser.add_argument("--active", type=int, default=24, help="conversations open at once")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--rounds", type=int, default=1, help="run the arms this many times, interleaved")
    parser.add_argument("--dump-metrics", default="", help="print gateway metric lines containing these")
    parser.add_argument(
        "--tokenizer",
        default="",
        help="a tokenizer directory for engines and exact-local (tiny, tiny-markers: build one)",
    )
    args = parser.parse_args()
    args.model = MODEL
    block_tokens = 32 if args.engine == "vllm" else 16
    fleet_tokens = args.replicas * args.kv_blocks * block_tokens
    working_set = args.docs * (args.doc_tokens + 3) + args.active * 4 * 80
    ratio = working_set / fleet_tokens
    print(f"fleet KV {fleet_tokens} tokens; working set ≈ {working_set} tokens ({ratio:.2f}×)")
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="exact-bench-") as tmp:
        if args.tokenizer in ("tiny", "tiny-markers"):  # -markers: <|role|> are special tokens
            markers = args.tokenizer == "tiny-markers"
            args.tokenizer = str(build_tokenizer(Path(tmp) / "tokenizer", chat_markers=markers))
        if args.tokenizer:
            os.environ["LLMGW_SIM_TOKENIZER"] = args.tokenizer  # the simulators inherit it
        vllm: list[Any] = []
        if args.engine == "vllm":
            from loadtest.realvllm.fleet import MODEL_NAME, ReplicaOptions, ensure_model, start_replicas

            options = ReplicaOptions(num_blocks=args.kv_blocks, block_size=32, kv_events=True)
            vllm = start_replicas(args.replicas, options, log_dir=Path(tmp) / "vllm", timeout_s=420)
            args.model, args.tokenizer = MODEL_NAME, str(ensure_model())  # its tokenizer.json
        try:
            for round_ in range(args.rounds):  # arms interleaved: the shared host's load drifts
                for name in args.arms.split(","):
                    fleet = [r.url for r in vllm] or None
                    row = asyncio.run(run_arm(name, args, Path(tmp) / str(round_), fleet))
                    runs.setdefault(name, []).append(row)
        finally:
            if vllm:
                from loadtest.realvllm.fleet import stop_replicas

                stop_replicas(vllm)
    rows = [_median(arm_runs) for arm_runs in runs.values()]
    if args.rounds > 1:
        print(f"medians over {args.rounds} interleaved rounds")
    print(
        "| arm | requests | engine hit ratio | TTFT p50 ms | TTFT p99 ms "
        "| mean abs(pred − actual) tokens | exact predictions | busiest replica's share "
        "| /tokenize calls | mean /tokenize wait ms | local tokenizations | mean local ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['arm']} | {r['requests']} | {r['hit_ratio']:.3f} | {r['ttft_p50_ms']:.1f} | "
            f"{r['ttft_p99_ms']:.1f} | {r['mean_abs_error_tokens']:.1f} | {r['exact_predictions']:.1%} | "
            f"{r['max_share']:.1%} | {r['tokenize_calls']} | {r['tokenize_ms']:.1f} | "
            f"{r['local_calls']} | {r['local_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
