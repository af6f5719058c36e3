"""Continuous-batching scheduler modelled on vLLM v1.

One asyncio task runs engine steps: running sequences are scheduled first (one
decode token each, or their next prefill chunk), then waiting requests are admitted
FCFS while max_num_seqs, the token budget and free KV blocks allow. A step takes
modelled GPU time (base + prefill tokens + KV context) divided by time_scale. When a
running sequence cannot get a block, the newest running request is preempted and
recomputed later, as vLLM does. Wall time per step is measured against the model so
an overloaded host is detectable (`fidelity_ratio`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .config import SimConfig
from .kvcache import KVCache, SeqBlocks, block_hashes
from .lora import LoraSlots
from .tokenizer import output_word, token_id

WAITING, RUNNING, FINISHED, ABORTED = "waiting", "running", "finished", "aborted"
# vLLM 0.32's `finished_reason` label values of vllm:request_success_total, in its order.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
_ids = itertools.count()


class RequestTooLong(ValueError):
    """Prompt plus output can never fit in the KV cache."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new requests."""


@dataclass(eq=False)
class SimRequest:
    """One generation request as the engine sees it."""

    prompt_tokens: list[int]
    max_tokens: int
    seed: int = 0
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    external_tokens: int = 0  # KV received from a remote prefill (P/D): not computed here
    priority: int = 0  # vLLM semantics: lower is served earlier (only with the priority policy)
    lora: str | None = None  # the LoRA adapter it runs (None: the base model)
    arrival: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    output_words: list[str] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = -1  # set on first admission (reported as cached_tokens)
    num_created_cache_tokens: int = 0  # prompt tokens this request newly wrote to the prefix cache
    status: str = WAITING
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    last_block_ids: list[int] = field(default_factory=list)  # blocks held at finish (P/D)
    blocks: SeqBlocks = field(default_factory=SeqBlocks)
    out: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - len(self.prompt_tokens)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival


@dataclass
class StepStats:
    steps: int = 0
    model_s: float = 0.0
    wall_s: float = 0.0
    ema_wall_s: float = 0.0
    ema_model_s: float = 0.0
    last_model_s: float = 0.0
    last_wall_s: float = 0.0


class Engine:
    """The simulated model executor plus scheduler for one replica."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.kv = KVCache(config.kv_blocks, config.block_size)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.slow_factor = 1.0
        self.num_preemptions = 0
        # Every ended request by reason, client disconnects included (admin state).
        self.finished: dict[str, int] = {"length": 0, "abort": 0}
        # What vLLM counts in vllm:request_success_total: requests the engine itself finished.
        # A client disconnect is not one of them (vLLM 0.32 leaves the "abort" series at 0).
        self.success: dict[str, int] = dict.fromkeys(FINISHED_REASONS, 0)
        self.stopped = False
        self._drained: asyncio.Event | None = None
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.stats = StepStats()
        self.on_first_token: Callable[[SimRequest], None] | None = None
        self.on_finish: Callable[[SimRequest], None] | None = None
        self.on_step: Callable[[], None] | None = None  # after each step (KV-event publishing)
        self.lora: LoraSlots | None = None  # with --enable-lora (loadtest.simulator.lora)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lag = 0.0

    # ---- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for req in [*self.running, *self.waiting]:
            self.abort(req)

    def close_admission(self) -> None:
        """Shutting down: new requests are refused, in-flight ones carry on."""
        self.stopped = True

    async def shutdown(self) -> None:
        """SIGTERM, as vLLM with --shutdown-timeout 0: stop stepping and end every request now.

        Each one finishes with ``finish_reason == "abort"`` and the tokens it has so far, so its
        handler still answers the client (a 200, or a stream closed by an abort chunk).
        """
        self.stopped = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        now = time.monotonic()
        for req in [*self.running, *self.waiting]:
            self._finish(req, now, "abort")

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    async def drain(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for every request to end."""
        if self.idle or timeout_s <= 0:
            return
        self._drained = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained.wait(), timeout_s)

    def _ended(self) -> None:
        if self._drained is not None and self.idle:
            self._drained.set()

    # ---- requests ------------------------------------------------------------
    def _enqueue(self, req: SimRequest) -> None:
        """FCFS, or with ``scheduling_policy == "priority"`` by (priority, arrival), like vLLM."""
        if self.config.scheduling_policy != "priority" or not self.waiting:
            self.waiting.append(req)
            return
        key = (req.priority, req.arrival)
        for index, other in enumerate(self.waiting):
            if (other.priority, other.arrival) > key:
                self.waiting.insert(index, req)
                return
        self.waiting.append(req)

    def add_request(self, req: SimRequest) -> SimRequest:
        if self.stopped:
            raise EngineStopped("the engine is shutting down")
        bs = self.config.block_size
        need = -(-(req.num_prompt_tokens + req.max_tokens) // bs)
        if need > self.kv.num_blocks:
            raise RequestTooLong(
                f"prompt ({req.num_prompt_tokens} tokens) plus max_tokens ({req.max_tokens}) needs "
                f"{need} KV blocks but the cache only has {self.kv.num_blocks}"
            )
        if req.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        req.external_tokens = min(req.external_tokens, req.num_prompt_tokens - 1)
        req.status = WAITING
        self._enqueue(req)
        self.prompt_tokens_total += req.num_prompt_tokens
        self._wake.set()
        return req

    def abort(self, req: SimRequest) -> None:
        """Drop a request now (client went away); its blocks are freed immediately."""
        if req.status in (FINISHED, ABORTED):
            return
        if req.status == RUNNING:
            try:
                self.running.remove(req)
            except ValueError:
                pass
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req.blocks)
        req.status = ABORTED
        req.finish_reason = "abort"
        req.finish_time = time.monotonic()
        self.finished["abort"] += 1
        req.out.put_nowait(None)
        self._ended()

    # ---- state ---------------------------------------------------------------
    @property
    def fidelity_ratio(self) -> float:
        """Recent step wall time over modelled step time (~1.0 = faithful, >1 = host too slow)."""
        s = self.stats
        return s.ema_wall_s / s.ema_model_s if s.ema_model_s > 0 else 1.0

    def state(self) -> dict[str, object]:
        s = self.stats
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_blocks": self.kv.num_blocks,
            "free_blocks": self.kv.num_free,
            "active_blocks": self.kv.num_blocks - self.kv.num_free,
            "cached_blocks": self.kv.num_cached,
            "kv_usage": self.kv.usage,
            "evictions": self.kv.evictions,
            "prefix_cache_queries_tokens": self.kv.queries_tokens,
            "prefix_cache_hits_tokens": self.kv.hits_tokens,
            "preemptions": self.num_preemptions,
            "finished": dict(self.finished),
            "steps": s.steps,
            "step_model_s_total": s.model_s,
            "step_wall_s_total": s.wall_s,
            "step_wall_over_model_ratio": self.fidelity_ratio,
            "step_wall_over_model_total": s.wall_s / s.model_s if s.model_s > 0 else 1.0,
            "slow_factor": self.slow_factor,
        }

    # ---- scheduler -------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.waiting and not self.running:
                self._lag = 0.0
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = loop.time()
            batch = self._schedule()
            if not batch:  # nothing schedulable (should not happen); avoid spinning
                await asyncio.sleep(self.config.decode_step_ms / 1000 / self.config.time_scale)
                continue
            model_s = self._step_cost(batch)
            # Sleep to the modelled end of step, catching up on earlier overruns.
            delay = model_s - self._lag - (loop.time() - t0)
            await asyncio.sleep(max(0.0, delay))
            self._complete(batch)
            if self.on_step is not None:
                self.on_step()
            wall = loop.time() - t0
            self._lag = max(0.0, self._lag + wall - model_s)
            self._lag = min(self._lag, 1.0)
            s = self.stats
            s.steps += 1
            s.model_s += model_s
            s.wall_s += wall
            s.last_model_s, s.last_wall_s = model_s, wall
            s.ema_wall_s = 0.95 * s.ema_wall_s + 0.05 * wall
            s.ema_model_s = 0.95 * s.ema_model_s + 0.05 * model_s

    def _step_cost(self, batch: list[tuple[SimRequest, int]]) -> float:
        cfg = self.config
        prefill = 0
        kv_tokens = 0
        for req, n in batch:
            decoding = n == 1 and req.num_output_tokens > 0 and req.num_computed == len(req.tokens) - 1
            if not decoding:
                prefill += n
            kv_tokens += req.num_computed + n
        us = (
            cfg.decode_step_ms * 1000
            + cfg.prefill_us_per_token * prefill
            + cfg.decode_us_per_kv_token * kv_tokens
        )
        if self.lora is not None:
            us += self.lora.step_us((req for req, _ in batch), self.waiting)
        return us / 1e6 * self.slow_factor / cfg.time_scale

    def _preempt(self, req: SimRequest) -> None:
        self.kv.free(req.blocks)
        req.status = WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _schedule(self) -> list[tuple[SimRequest, int]]:
        cfg = self.config
        budget = cfg.max_batched_tokens
        batch: list[tuple[SimRequest, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(len(req.tokens) - req.num_computed, budget)
            ok = True
            while not self.kv.allocate(req.blocks, req.num_computed + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    ok = False
                    break
            if not ok:
                break
            batch.append((req, n))
            budget -= n
            i += 1
        if preempted:
            return batch
        bs = cfg.block_size
        loras = self.lora.scheduled(self.running) if self.lora is not None else None
        skipped: deque[SimRequest] = deque()  # waiting for an adapter slot (vLLM v1: skipped)
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            if loras is not None and self.lora is not None:
                if not self.lora.can_join(req.lora, loras):
                    skipped.append(self.waiting.popleft())
                    continue
                if req.lora is not None:
                    loras.add(req.lora)
            hashes = block_hashes(req.tokens, bs, parent=req.blocks.root)
            hit = self.kv.match_prefix(hashes)
            if len(hit) * bs >= len(req.tokens):  # must compute at least one token
                hit = hit[:-1]
            start = max(len(hit) * bs, req.external_tokens)
            n = min(len(req.tokens) - start, budget)
            need = -(-(start + n) // bs) - len(hit)
            if not self.kv.can_allocate(need, hit):
                break  # FCFS: head of line waits for blocks
            self.waiting.popleft()
            self.kv.touch(req.blocks, hit, hashes)
            self.kv.allocate(req.blocks, start + n)
            self.kv.record_query(len(req.tokens), len(hit) * bs)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = start
            req.num_computed = start
            req.status = RUNNING
            self.running.append(req)
            batch.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return batch

    def _complete(self, batch: list[tuple[SimRequest, int]]) -> None:
        now = time.monotonic()
        for req, n in batch:
            if req.status != RUNNING:
                continue  # aborted while the step ran
            req.num_computed += n
            created = self.kv.cache_full_blocks(req.blocks, req.tokens, req.num_computed)
            if created:
                bs = self.config.block_size
                full_prompt_blocks = req.num_prompt_tokens // bs
                req.num_created_cache_tokens += bs * sum(1 for i in created if i < full_prompt_blocks)
            if req.num_computed < len(req.tokens):
                continue  # partial prefill chunk: no token sampled
            word = output_word(req.seed, req.num_output_tokens)
            req.tokens.append(token_id(word))
            req.output_words.append(word)
            self.generation_tokens_total += 1
            req.out.put_nowait(word if req.num_output_tokens == 1 else " " + word)
            if req.first_token_time is None:
                req.first_token_time = now
                if self.on_first_token is not None:
                    self.on_first_token(req)
            if req.num_output_tokens >= req.max_tokens:
                self._finish(req, now)

    def _finish(self, req: SimRequest, now: float, reason: str = "length") -> None:
        """The engine ends `req` itself (its client still gets an answer), unlike `abort`."""
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.last_block_ids = list(req.blocks.block_ids)
        self.kv.free(req.blocks)
        req.status = FINISHED
        req.finish_reason = reason
        req.finish_time = now
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if reason != "abort":
            self.success[reason] += 1
        req.out.put_nowait(None)
        self._ended()
        if self.on_finish is not None:
            self.on_finish(req)
