"""Per-request cost of the engine's prompt tokens: computed in the gateway vs the engine's ``/tokenize``.

    .venv/bin/python -m loadtest.tokenize_bench                       # a simulator with the real tokenizer
    .venv/bin/python -m loadtest.tokenize_bench --vllm                # starts one real vLLM CPU replica
    .venv/bin/python -m loadtest.tokenize_bench --engine-url http://127.0.0.1:8000 --model tiny-llama \\
        --tokenizer ~/.cache/llm-gateway/venv-vllm/models/tiny-llama   # a real vLLM replica

Chat requests whose prompt (after the tiny Llama's chat template) is ~1k and ~8k tokens, a
new one per request (no cache anywhere). Local: the gateway's path as a request sees it —
render + encode in the tokenizer thread pool, awaited from the event loop — and, for
reference, the same work inline. Engine: ``POST /tokenize`` over one keep-alive
connection. p50/p99 per request; the tokens of every request are checked equal. "next turn":
the same conversation one turn later, its start tokenized just before (the prefix cache of
:mod:`gateway.prefix.prefix_tokens`, which needs turn delimiters that are special tokens:
``--chat-markers`` builds the tiny tokenizer with its ``<|role|>`` markers as such).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp

from gateway.prefix.local_tokenizer import LocalTokenizer
from loadtest.harness.fleet import start_replicas, stop_all
from loadtest.realvllm.model import _WORDS, build_tokenizer
from loadtest.report import nearest_rank


def body(tok: LocalTokenizer, target: int, seed: int) -> dict[str, Any]:
    """A two-message chat of about ``target`` prompt tokens (words of the tiny vocabulary)."""
    rng = random.Random(seed)
    words: list[str] = []
    while True:
        words.extend(rng.choice(_WORDS) for _ in range(256))
        messages = [
            {"role": "system", "content": f"Request {seed}. " + " ".join(words)},
            {"role": "user", "content": f"question {seed}: which of these?"},
        ]
        if len(tok.encode(tok.chat_text({"messages": messages}), False)) >= target:  # no prefix cache
            return {"messages": messages}


def pct(values: list[float], q: float) -> float:
    return nearest_rank(sorted(values), q)


async def measure(args: argparse.Namespace, url: str, tok: LocalTokenizer) -> list[dict[str, Any]]:
    rows = []
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="bench-tokenize")
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        for target in args.sizes:
            bodies = [body(tok, target, 1000 * target + i) for i in range(args.requests)]
            timings: dict[str, list[float]] = {
                "local (pool, awaited)": [],
                "local (inline, no prefix cache)": [],
                "/tokenize": [],
                "local, next turn (pool, awaited)": [],
            }
            equal = equal_next = 0
            for b in bodies:
                started = time.perf_counter()
                mine = await loop.run_in_executor(pool, tok.chat_tokens, b)
                timings["local (pool, awaited)"].append(time.perf_counter() - started)
                started = time.perf_counter()
                tok.encode(tok.chat_text(b), False)
                timings["local (inline, no prefix cache)"].append(time.perf_counter() - started)
                started = time.perf_counter()
                async with session.post(url + "/tokenize", json={"model": args.model, **b}) as resp:
                    resp.raise_for_status()
                    theirs = (await resp.json())["tokens"]
                timings["/tokenize"].append(time.perf_counter() - started)
                equal += mine == theirs
                # the conversation's next turn: its first part was tokenized just above
                nxt = {"messages": [*b["messages"], {"role": "assistant", "content": "the stone arch"},
                                    {"role": "user", "content": "and the next one?"}]}  # fmt: skip
                started = time.perf_counter()
                mine = await loop.run_in_executor(pool, tok.chat_tokens, nxt)
                timings["local, next turn (pool, awaited)"].append(time.perf_counter() - started)
                async with session.post(url + "/tokenize", json={"model": args.model, **nxt}) as resp:
                    equal_next += mine == (await resp.json())["tokens"]
            engine_p50 = statistics.median(timings["/tokenize"])
            for path, values in timings.items():
                rows.append({
                    "prompt": f"~{target // 1000}k ({len(mine)} tokens)",
                    "path": path,
                    "p50_ms": 1000 * statistics.median(values),
                    "p99_ms": 1000 * pct(values, 0.99),
                    "vs_tokenize": statistics.median(values) / engine_p50,
                    "equal": f"{equal_next if 'next' in path else equal}/{len(bodies)}",
                })  # fmt: skip
    pool.shutdown()
    return rows


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="tokenize-bench-") as tmp:
        directory = (
            Path(args.tokenizer)
            if args.tokenizer
            else build_tokenizer(Path(tmp) / "tokenizer", chat_markers=args.chat_markers)
        )
        tok = LocalTokenizer(directory)
        procs: list[Any] = []
        replicas: list[Any] = []
        url = args.engine_url
        if args.vllm:
            from loadtest.realvllm import fleet

            directory = fleet.ensure_model()
            tok, args.model = LocalTokenizer(directory), fleet.MODEL_NAME
            replicas = await asyncio.to_thread(fleet.start_replicas, 1, log_dir=Path(tmp))
            url = replicas[0].url
        elif not url:
            os.environ["LLMGW_SIM_TOKENIZER"] = str(directory)  # the simulator tokenizes as the gateway
            procs = await start_replicas(1, ["--model", args.model], log_dir=Path(tmp))
            url = procs[0].url
        try:
            rows = await measure(args, url, tok)
        finally:
            await stop_all(procs)
            if replicas:
                from loadtest.realvllm.fleet import stop_replicas

                await asyncio.to_thread(stop_replicas, replicas)
    engine = (
        "real vLLM 0.32 (CPU)"
        if args.engine_url or args.vllm
        else "the simulator (real tokenizer.json, one event loop)"
    )
    print(f"engine: {engine}; {args.requests} requests per size, sequential")
    print("| prompt | path | p50 ms | p99 ms | p50 / /tokenize p50 | tokens equal |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['prompt']} | {r['path']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['vs_tokenize']:.3f} | {r['equal']} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-url", default="", help="a running engine (default: start a simulator)")
    parser.add_argument("--vllm", action="store_true", help="start one real vLLM replica (the tiny Llama)")
    parser.add_argument("--model", default="sim-llama")
    parser.add_argument("--tokenizer", default="", help="tokenizer directory (default: the tiny Llama's)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument(
        "--chat-markers", action="store_true", help="the tiny tokenizer with <|role|> as special tokens"
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 8000])
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
