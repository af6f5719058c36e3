"""Reads engine load from Prometheus text: vLLM and SGLang metric names.

A vLLM ``/metrics`` page is ~60 KB, nearly all of it histograms we do not need.
Parsing it whole every second per endpoint would cost real CPU, so the text is
first cut down to the few families we read, then parsed with prometheus_client's
own parser (no hand-rolled exposition-format parsing).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from gateway.fleet.endpoint import EngineKind
from gateway.fleet.lora import LORA_METRIC, LoraLoad, lora_load

__all__ = ["ScrapedLoad", "parse_engine_metrics"]


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


def _int_label(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


def parse_engine_metrics(text: str, engine: EngineKind, rank: str | None = None) -> ScrapedLoad:
    """Sum across label sets (several models or engines behind one port add up).

    ``rank``: only the series of that data-parallel rank (``engine="<rank>"``; unlabelled ones
    are kept)."""
    families = _FAMILIES[engine]
    load = ScrapedLoad()
    sums: dict[str, float] = {}
    legacy_kv: float | None = None
    for family in text_string_to_metric_families(_wanted_lines(text, tuple(families))):
        field = families.get(family.name)
        if field is None:
            continue
        if field == "lora":  # read whole: the latest of its samples wins
            load.lora = lora_load(family.samples)
            continue
        for sample in family.samples:
            if rank is not None and sample.labels.get("engine", rank) != rank:
                continue
            limit = _MAX_COUNTER if field == "restart_marker" else _MAX_GAUGE
            if field != "cache_config" and not 0 <= sample.value <= limit:
                continue  # NaN/Inf, negative or absurd: "not reported", never a load value
            if field == "cache_config":
                load.block_size = _int_label(sample.labels, "block_size")
                load.num_blocks = _int_label(sample.labels, "num_gpu_blocks")
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
