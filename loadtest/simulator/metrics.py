"""Prometheus metrics under the engines' real names.

A per-app CollectorRegistry keeps several simulators in one process apart. Gauges
and counters are read from the engine at scrape time, so they can never drift from
the scheduler's state; only the TTFT histogram is observed as tokens appear.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .config import SimConfig
from .engine import FINISHED_REASONS, Engine, SimRequest

# vLLM's TTFT buckets.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


def cache_config_labels(cfg: SimConfig) -> dict[str, str]:
    """vLLM 0.32's vllm:cache_config_info labels (no model_name), valued for this replica.

    The label set is the one real vLLM emits (tests/data/vllm-0.32-cpu-metrics-sample.txt); the
    values are those of a GPU replica started with ``--block-size B --num-gpu-blocks-override N
    --max-model-len L`` (the gateway reads block_size and num_gpu_blocks).
    """
    tokens = cfg.kv_blocks * cfg.block_size
    bs = str(cfg.block_size)
    return {
        "_block_size_resolved": "True",
        "block_size": bs,
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": bs,
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": "True",
        "engine": "0",
        "gpu_memory_utilization": "0.92",
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(tokens / cfg.max_model_len),
        "kv_cache_memory_bytes": "None",
        "kv_cache_size_tokens": str(tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(cfg.kv_blocks),
        "num_gpu_blocks_override": str(cfg.kv_blocks),
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "True",
    }


class PDCounters:
    """P/D KV-transfer outcomes of this replica."""

    def __init__(self) -> None:
        self.honoured = 0
        self.recomputed = 0


class _Emit:
    """One gauge or counter sample under the engine's labels."""

    def __init__(self, names: list[str], values: list[str]) -> None:
        self.names, self.values = names, values

    def gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=self.names)
        g.add_metric(self.values, value)
        return g

    def counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=self.names)
        c.add_metric(self.values, value)
        return c


class _EngineCollector(Collector):
    def __init__(self, engine: Engine, pd: PDCounters, rank: int = 0) -> None:
        self.engine = engine
        self.pd = pd
        self.rank = rank  # vLLM's engine="<DP rank>" label

    def _labels(self) -> tuple[list[str], list[str]]:
        cfg = self.engine.config
        if cfg.engine == "vllm":
            return ["engine", "model_name"], [str(self.rank), cfg.model]
        return ["model_name"], [cfg.model]

    def collect(self) -> Iterator[Metric]:
        names, values = self._labels()
        emit = _Emit(names, values)
        if self.engine.config.engine == "vllm":
            yield from self._vllm(emit)
        else:
            yield from self._sglang(emit)
        yield from self._sim(emit)

    def _vllm(self, emit: _Emit) -> Iterator[Metric]:
        e, gauge, counter, names, values = self.engine, emit.gauge, emit.counter, emit.names, emit.values
        yield gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", len(e.running)
        )
        yield gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(e.waiting)
        )
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv.usage)
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            e.kv.queries_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            e.kv.hits_tokens,
        )
        yield counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", e.num_preemptions
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", e.prompt_tokens_total)
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", e.generation_tokens_total
        )
        succ = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        for reason in FINISHED_REASONS:
            succ.add_metric([*values, reason], e.success[reason])
        yield succ
        info_labels = {**cache_config_labels(e.config), "engine": str(self.rank)}
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info_labels)
        )
        info.add_metric(list(info_labels.values()), 1.0)
        yield info

    def _sglang(self, emit: _Emit) -> Iterator[Metric]:
        e, gauge, counter = self.engine, emit.gauge, emit.counter
        q = e.kv.queries_tokens
        yield gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", len(e.waiting))
        yield gauge("sglang:num_running_reqs", "The number of running requests.", len(e.running))
        yield gauge("sglang:token_usage", "The token usage.", e.kv.usage)
        yield gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", e.kv.hits_tokens / q if q else 0.0)
        yield counter("sglang:prompt_tokens", "Number of prefill tokens processed.", e.prompt_tokens_total)
        yield counter(
            "sglang:generation_tokens",
            "Number of generation tokens processed.",
            e.generation_tokens_total,
        )
        yield counter("sglang:cached_tokens", "Number of cached prompt tokens.", e.kv.hits_tokens)
        yield counter("sglang:num_requests", "Number of requests processed.", sum(e.finished.values()))

    def _sim(self, emit: _Emit) -> Iterator[Metric]:
        e, gauge, counter, names, values = self.engine, emit.gauge, emit.counter, emit.names, emit.values
        yield gauge(
            "sim:step_wall_over_model_ratio",
            "Recent engine step wall time over modelled step time (1 = faithful).",
            e.fidelity_ratio,
        )
        yield counter("sim:steps", "Engine steps executed.", e.stats.steps)
        pd = CounterMetricFamily(
            "sim:pd_transfers", "P/D KV transfers by outcome.", labels=[*names, "outcome"]
        )
        pd.add_metric([*values, "honoured"], self.pd.honoured)
        pd.add_metric([*values, "recomputed"], self.pd.recomputed)
        yield pd


# Measured on vLLM 0.32's CPU build with --data-parallel-size 2: these gauges carry engine="0"
# only; its counters, histograms and cache_config_info carry every rank.
_RANK0_ONLY = frozenset(
    {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
)


class _RanksCollector(Collector):
    """Data parallel: every rank's families merged, one family per name (as vLLM's page)."""

    def __init__(self, ranks: list[_EngineCollector]) -> None:
        self.ranks = ranks

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for collector in self.ranks:
            for family in collector.collect():
                if collector.rank and family.name in _RANK0_ONLY:
                    continue
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        yield from merged.values()


def _observer(child: Histogram) -> Callable[[SimRequest], None]:
    def observe(req: SimRequest) -> None:
        if req.ttft is not None:
            child.observe(req.ttft)

    return observe


class SimMetrics:
    """Registry plus the live TTFT histogram for one simulator app (``ranks``: its DP engines)."""

    def __init__(self, engine: Engine, pd: PDCounters, ranks: list[Engine] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        if ranks and len(ranks) > 1:
            collectors = [_EngineCollector(e, pd if r == 0 else PDCounters(), r) for r, e in enumerate(ranks)]
            self.registry.register(_RanksCollector(collectors))
        else:
            self.registry.register(_EngineCollector(engine, pd))
        prefix = "vllm" if engine.config.engine == "vllm" else "sglang"
        labelnames = ["engine", "model_name"] if prefix == "vllm" else ["model_name"]
        labelvalues = ["0", engine.config.model] if prefix == "vllm" else [engine.config.model]
        ttft = Histogram(
            f"{prefix}:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labelnames=labelnames,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self._ttft = ttft.labels(*labelvalues)
        engine.on_first_token = self._observe_ttft
        for rank, other in enumerate(ranks or []):
            if rank and prefix == "vllm":
                other.on_first_token = _observer(ttft.labels(str(rank), engine.config.model))

    def _observe_ttft(self, req: SimRequest) -> None:
        ttft = req.ttft
        if ttft is not None:
            self._ttft.observe(ttft)
