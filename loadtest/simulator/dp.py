"""vLLM's ``--data-parallel-size N``: N schedulers, each with its own KV cache, behind one port.

What vLLM 0.32 does and this models (``vllm/v1/engine/core_client.py``,
``input_processor.py``, ``distributed/kv_events.py``):

- ``X-data-parallel-rank: R`` sends the request to rank R; a value that is not an integer
  is ignored (balanced as if absent); an integer outside ``[0, N)`` is a 400
  ``data_parallel_rank R is out of range [0, N).``
- without the header the front end's coordinator picks the least loaded rank: score
  ``waiting + running`` (+ ``6·waiting·max(0, kv_usage − 0.5)``), ties broken by a start
  index that rotates on every pick;
- its counters, histograms and ``vllm:cache_config_info`` carry ``engine="<rank>"`` for every
  rank, but the scheduler gauges (``num_requests_running``/``waiting``, ``kv_cache_usage_perc``)
  only ``engine="0"`` (measured on the CPU build with ``--data-parallel-size 2``);
- each rank publishes its own KV events, its PUB and replay ports offset by the rank, its
  rank in every ``EventBatch``; ``GET /kv_event_sources`` answers one config per rank.

Rank 0 is the simulator's ``SimState.engine``, so single-rank code paths are unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from aiohttp import web

from .config import SimConfig
from .engine import Engine
from .kv_events import KVEventPublisher
from .wire import error_response

__all__ = ["RANK_HEADER", "DataParallel", "requested_rank"]

RANK_HEADER = "X-data-parallel-rank"


def requested_rank(request: web.Request, ranks: int) -> int | web.Response | None:
    """The rank ``X-data-parallel-rank`` names (None: absent or not an integer), or vLLM's 400.

    vLLM checks the header on every server, one without data parallelism too (one rank):
    ``1`` there is the same 400 as ``2`` on a server of two ranks."""
    raw = request.headers.get(RANK_HEADER)
    if raw is None:
        return None
    try:
        rank = int(raw)
    except ValueError:
        return None  # vLLM: an unparsable header is no header
    if not 0 <= rank < ranks:
        return error_response(
            400, f"data_parallel_rank {rank} is out of range [0, {ranks}).", "BadRequestError"
        )
    return rank


class DataParallel:
    """The ranks of one simulated server and vLLM's choice among them."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        self.engines = list(engines)
        self.publishers: list[KVEventPublisher] = []
        self._start = 0
        self.picked = [0] * len(self.engines)  # requests per rank (tests, admin state)

    @classmethod
    def build(cls, config: SimConfig, first: Engine) -> DataParallel:
        return cls([first, *(Engine(config) for _ in range(1, config.data_parallel_size))])

    def publish(self, config: SimConfig) -> None:
        """One KV-event publisher per rank on ports offset by the rank (vLLM's offset_endpoint_port)."""

        def port(base: int, rank: int) -> int:
            return base + rank if base else 0

        for rank, engine in enumerate(self.engines):
            publisher = KVEventPublisher(
                engine.kv,
                host=config.host,
                port=port(config.kv_events_port, rank),
                replay_port=port(config.kv_events_replay_port, rank),
                topic=config.kv_events_topic,
                data_parallel_rank=rank,
            )
            engine.on_step = publisher.flush
            self.publishers.append(publisher)

    def pick(self, request: web.Request) -> Engine | web.Response:
        """The rank the header names, else the least loaded; a 400 for a rank out of range."""
        rank = requested_rank(request, len(self.engines))
        if isinstance(rank, web.Response):
            return rank
        if rank is None:
            rank = self._least_loaded()
        self.picked[rank] += 1
        return self.engines[rank]

    def _least_loaded(self) -> int:
        best, best_score = 0, float(sys.maxsize)
        n = len(self.engines)
        for i in range(n):
            idx = (self._start + i) % n
            engine = self.engines[idx]
            waiting = len(engine.waiting)
            score = float(waiting + len(engine.running))
            if waiting:
                score += waiting * 6.0 * max(0.0, engine.kv.usage - 0.5)
            if score < best_score:
                best, best_score = idx, score
        self._start = (self._start + 1) % n
        return best

    def sources(self) -> dict[str, object]:
        return {str(p.data_parallel_rank): p.sources() for p in self.publishers}

    def state(self) -> list[dict[str, object]]:
        return [{"rank": r, "picked": self.picked[r], **e.state()} for r, e in enumerate(self.engines)]
