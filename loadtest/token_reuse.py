"""How much of each prompt the gateway's local tokenizer encodes on ``exact_bench``'s workload.

    .venv/bin/python -m loadtest.token_reuse [--requests 1500] [--in-flight 4]

Replays the workload of :mod:`loadtest.exact_bench` (documents as system prompts, Zipf
popularity, multi-turn conversations, several in flight) through
:class:`gateway.prefix.local_tokenizer.LocalTokenizer` with the tiny Llama's tokenizer, the
answers random words of its vocabulary, and reports the characters encoded per request (the
rest come from the prefix cache of :mod:`gateway.prefix.prefix_tokens`) and the render + encode
time. No engine, no network: run it on two source trees (``PYTHONPATH=<tree>``) to compare.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from gateway.prefix.local_tokenizer import LocalTokenizer
from loadtest.exact_bench import VLLM_MAX_WORDS, Workload
from loadtest.realvllm.model import _WORDS, build_tokenizer


def replay(requests: int, in_flight: int, answer_words: int = 24, seed: int = 3) -> dict[str, Any]:
    """Characters encoded and seconds spent per request, and the cache's hits."""
    with tempfile.TemporaryDirectory(prefix="token-reuse-") as tmp:
        return _replay(
            LocalTokenizer(build_tokenizer(Path(tmp) / "tokenizer")), requests, in_flight, answer_words, seed
        )


def _replay(
    tok: LocalTokenizer, requests: int, in_flight: int, answer_words: int, seed: int
) -> dict[str, Any]:
    work = Workload(12, 700, 12, natural=True, max_words=VLLM_MAX_WORDS)
    rng = random.Random(seed)
    waiting: deque[tuple[int, list[dict[str, str]]]] = deque()  # sent, answer still to come
    encoded = total = 0
    spent = 0.0
    for turn in range(requests):
        if len(waiting) >= in_flight:
            _, conversation = waiting.popleft()
            answer = " ".join(rng.choice(_WORDS) for _ in range(answer_words))
            conversation.append({"role": "assistant", "content": answer})
        cid, messages = work.next(turn, {c for c, _ in waiting})
        started = time.perf_counter()
        prepared = tok.prepare("chat", {"messages": messages})
        tok.finish(prepared)
        spent += time.perf_counter() - started
        encoded += prepared.remaining
        total += len(prepared.text)
        waiting.append((cid, work.conversations[cid]))
    return {
        "encoded_chars": encoded / requests,
        "prompt_chars": total / requests,
        "ms": 1000 * spent / requests,
        "hits": tok.prefix.hits,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--in-flight", type=int, default=4, help="conversations waiting for an answer")
    args = parser.parse_args(argv)
    r = replay(args.requests, args.in_flight)
    print(
        f"{args.in_flight} in flight: {r['encoded_chars']:.0f} of {r['prompt_chars']:.0f} characters "
        f"encoded a request ({r['encoded_chars'] / r['prompt_chars']:.1%}), {r['ms']:.2f} ms a request "
        f"(render + encode), {r['hits']} prefix-cache hits in {args.requests} requests"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
