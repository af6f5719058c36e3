"""What the prefix hashing of agent conversations costs per turn, with and without reuse.

``python -m loadtest.agent_hashing``: ``--sessions`` conversations share one system prompt
and tool list (``--system-kb``); each turn adds a question and an answer (``--turn-kb``) and
sends the whole conversation again, sessions interleaved, ``--turns`` turns each. Every
prompt is hashed twice in the same run, by ``block_hashes`` (the baseline: every byte) and
by the gateway's ``HashChainCache`` (its session's previous turn, or another session's system
prompt, reused; ``--sessionless``: found by the prompt's bytes alone); the hashes are compared,
and the time per turn and the ratio printed.
"""

from __future__ import annotations

import argparse
import time

from gateway.prefix.chain_cache import HashChainCache
from gateway.prefix.hashing import block_hashes


def _text(kb: float, seed: str) -> str:
    unit = f"{seed}: the quick brown fox reads src/main.py line by line; "
    return (unit * (int(kb * 1024) // len(unit) + 1))[: int(kb * 1024)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--system-kb", type=float, default=24.0)
    parser.add_argument("--turn-kb", type=float, default=1.5)
    parser.add_argument("--sessionless", action="store_true", help="send no session id (plain chat clients)")
    args = parser.parse_args()
    system = _text(args.system_kb, "system")
    conversations = [system] * args.sessions
    cache = HashChainCache()
    plain_s = reuse_s = 0.0
    prompt_bytes = 0
    for turn in range(args.turns):
        for session in range(args.sessions):
            conversations[session] += _text(args.turn_kb, f"s{session} t{turn}")
            prompt = conversations[session]
            prompt_bytes += len(prompt)
            start = time.perf_counter()
            plain = block_hashes("model", prompt, 64)
            middle = time.perf_counter()
            reused = cache.block_hashes(
                "model", prompt, 64, session=None if args.sessionless else f"s{session}"
            )
            end = time.perf_counter()
            plain_s += middle - start
            reuse_s += end - middle
            assert reused == plain, "the cache must give exactly block_hashes"
    n = args.sessions * args.turns
    print(
        f"{n:,} turns, mean prompt {prompt_bytes / n / 1024:.1f} KB, cache {cache.size_bytes / 2**20:.1f} MiB"
    )
    print(f"block_hashes     {plain_s / n * 1e6:8.1f} µs/turn")
    print(f"HashChainCache   {reuse_s / n * 1e6:8.1f} µs/turn  ({reuse_s / plain_s:.2f}x)")
    total = cache.reused_blocks + cache.hashed_blocks
    print(f"blocks reused    {cache.reused_blocks / total:.1%} of {total:,}")


if __name__ == "__main__":
    main()
