"""Reads engine load from Prometheus text: vLLM and SGLang metric names.

A vLLM ``/metrics`` page is ~60 KB, nearly all of it histograms we do not need.
Parsing it whole every second per endpoint would cost real CPU, so the text is
first cut down to the few families we read, then parsed with prometheus_client's
own parser (no hand-rolled exposition-format parsing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.fleet.endpoint import EngineKind
from gateway.fleet.kv_wire import MAX_BLOCK_SIZE
from gateway.fleet.lora import LORA_METRIC, LoraLoad, lora_load

__all__ = ["ScrapedLoad", "parse_engine_metrics", "parse_rank_metrics"]


@dataclass(slots=True)
class ScrapedLoad:
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    # Monotonic counters that reset when the engine restarts; used to detect restarts.
    restart_marker: float | None = None
    lora: LoraLoad | None = None  # vLLM with --enable-lora


_VLLM = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage_legacy",
    "vllm:cache_config_info": "cache_config",
    "vllm:prefix_cache_queries": "restart_marker",  # family name without _total
    LORA_METRIC: "lora",
}
_SGLANG = {
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_running_reqs": "running",
    "sglang:token_usage": "kv_usage",
}
_FAMILIES = {EngineKind.VLLM: _VLLM, EngineKind.SGLANG: _SGLANG}
# Beyond these a value is garbage (a broken exporter), not load: one absurd queue length fed to
# the latency model as a feature once poisoned its fit for good.
_MAX_GAUGE = 1e9
_MAX_COUNTER = float(2**63)


def _wanted_lines(text: str, names: tuple[str, ...]) -> str:
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("TYPE", "HELP") and parts[2].startswith(names):
                kept.append(line)
        elif line.startswith(names):
            kept.append(line)
    return "\n".join(kept) + "\n"


def _int_label(labels: dict[str, str], key: str, most: int) -> int | None:
    """A positive integer label up to ``most``; anything else is "not reported"."""
    value = labels.get(key, "")
    if not (value.isascii() and value.isdigit()) or not 0 < int(value) <= most:
        return None
    return int(value)


def _parsed(text: str, engine: EngineKind) -> tuple[list[Any] | None, list[tuple[str, Any]]]:
    """The page parsed once: the LoRA family's samples, and (field, sample) of every other wanted one."""
    families = _FAMILIES[engine]
    lora: list[Any] | None = None
    items: list[tuple[str, Any]] = []
    for family in text_string_to_metric_families(_wanted_lines(text, tuple(families))):
        field = families.get(family.name)
        if field == "lora":  # read whole: the latest of its samples wins
            lora = family.samples
        elif field is not None:
            items.extend((field, sample) for sample in family.samples)
    return lora, items


def parse_engine_metrics(text: str, engine: EngineKind, rank: str | None = None) -> ScrapedLoad:
    """Sum across label sets (several models or engines behind one port add up).

    ``rank``: only the series of that data-parallel rank (``engine="<rank>"``; unlabelled ones
    are kept)."""
    lora, items = _parsed(text, engine)
    if rank is not None:
        items = [(field, sample) for field, sample in items if sample.labels.get("engine", rank) == rank]
    return _load(lora, items)


def parse_rank_metrics(text: str, engine: EngineKind, ranks: Sequence[str]) -> dict[str, ScrapedLoad]:
    """:func:`parse_engine_metrics` for every rank in one parse of the page (per rank it was a
    parse each: 256 ranks on one page held the event loop for seconds)."""
    lora, items = _parsed(text, engine)
    shared: list[tuple[str, Any]] = []
    by_rank: dict[str, list[tuple[str, Any]]] = {rank: [] for rank in ranks}
    for field, sample in items:
        rank = sample.labels.get("engine")
        if rank is None:
            shared.append((field, sample))
        elif rank in by_rank:
            by_rank[rank].append((field, sample))
    return {rank: _load(lora, shared + own) for rank, own in by_rank.items()}


def _load(lora: list[Any] | None, items: list[tuple[str, Any]]) -> ScrapedLoad:
    load = ScrapedLoad()
    if lora is not None:
        load.lora = lora_load(lora)
    sums: dict[str, float] = {}
    legacy_kv: float | None = None
    for field, sample in items:
        limit = _MAX_COUNTER if field == "restart_marker" else _MAX_GAUGE
        if field != "cache_config" and not 0 <= sample.value <= limit:
            continue  # NaN/Inf, negative or absurd: "not reported", never a load value
        if field == "cache_config":
            load.block_size = _int_label(sample.labels, "block_size", MAX_BLOCK_SIZE)
            load.num_blocks = _int_label(sample.labels, "num_gpu_blocks", int(_MAX_GAUGE))
        elif field == "kv_usage":
            # Utilisation is a fraction: take the max over engines, not a sum.
            sums[field] = max(sums.get(field, 0.0), sample.value)
        elif field == "kv_usage_legacy":
            legacy_kv = max(legacy_kv or 0.0, sample.value)
        elif field == "restart_marker":
            if sample.name.endswith("_total"):
                sums[field] = sums.get(field, 0.0) + sample.value
        else:
            sums[field] = sums.get(field, 0.0) + sample.value
    load.waiting = sums.get("waiting")
    load.running = sums.get("running")
    load.kv_usage = sums.get("kv_usage", legacy_kv)
    load.restart_marker = sums.get("restart_marker")
    return load
