"""Gateway overhead against a zero-work upstream: direct vs gateway vs peer routers, one run.

``python -m loadtest.overhead [--duration 10] [--connections 64] [--workers-list 1,2]
[--policies round-robin,default] [--peers sglang-router,vllm-router] [--out bench-results/overhead]``

One run starts :mod:`loadtest.zero_upstream` (answers at once; the streaming variant sends
8 SSE chunks), then for each target — the upstream directly, ``llm-gateway serve`` for every
policy x ``--workers`` combination, and each peer router (``round_robin``) — checks one
non-streaming and one streaming answer by hand, then runs ``wrk`` (a separate process:
``-t1 -cC -dDs --latency -s loadtest/wrk/chat.lua`` and ``chat_stream.lua``) after a short
warm-up. wrk's text output is parsed (Requests/sec, the ``--latency`` distribution,
``Socket errors``, ``Non-2xx or 3xx responses``) and cross-checked against the exact
numbers the scripts' ``done()`` prints (``WRK_SUMMARY {json}``). A run with any socket
error or non-2xx answer is flagged ``ERR`` in the table and ``"flagged": true`` in the
JSON, never dropped.

Added latency is the target's percentile minus the direct run's percentile of the same
variant. CPU seconds of the router process tree and of the upstream are sampled from
``/proc`` around each wrk run, so "CPU ms per 1k requests" shows where the cores went.

``--profile`` additionally records the first gateway configuration with py-spy (a
separate wrk run, not part of the table: sampling costs the target some throughput) and
prints its hottest functions. Everything is bound to 127.0.0.1; every process started
here is stopped by its PID (SIGTERM, then SIGKILL of its own process group).
"""

from __future__ import annotations

from loadtest.harness.wrk import WrkResult, parse_wrk_output
from loadtest.overhead.cli import main, run_overhead

__all__ = ["WrkResult", "main", "parse_wrk_output", "run_overhead"]
