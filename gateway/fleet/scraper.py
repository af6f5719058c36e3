"""Reads engine load from Prometheus text: vLLM and SGLang metric names.

A vLLM ``/metrics`` page is ~60 KB, nearly all of it histograms we do not need.
Parsing it whole every second per endpoint would cost real CPU, so the text is
first cut down to the few families we read, then parsed with prometheus_client's
own parser (no hand-rolled exposition-format parsing).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.fleet.endpoint import EngineKind
from gateway.fleet.kv_wire import MAX_BLOCK_SIZE
from gateway.fleet.lora import LORA_METRIC, LoraLoad, lora_load

__all__ = ["ScrapedLoad", "ScrapedPage", "parse_engine_metrics", "parse_page"]


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


# Series with one sample per data-parallel rank. vLLM 0.32 (CPU build, --data-parallel-size 2)
# exports its gauges (running, waiting, KV usage) for engine="0" only, its counters and
# cache_config_info for every rank: the rank set is the union of their engine labels.
_PER_RANK = frozenset({"cache_config", "restart_marker", "running"})
_MAX_RANKS = 1024  # data-parallel ranks followed per server


def _rank(label: str) -> int | None:
    """A rank as vLLM numbers them ("0".."1023"); a padded ("01"), non-ASCII ("²") or larger
    label is none (vLLM would read "01" as rank 1 under another name)."""
    if len(label) <= 4 and label.isascii() and label.isdigit() and label == str(int(label)):
        return int(label) if int(label) < _MAX_RANKS else None
    return None


@dataclass(frozen=True, slots=True)
class ScrapedPage:
    """What a ``/metrics`` page says, read in one pass (off the event loop when the page is
    large): the replica's load, and each data-parallel rank's (its ``engine`` label)."""

    load: ScrapedLoad  # every series summed
    ranks: frozenset[int]  # the ranks labelled on the series every rank reports
    _lora: LoraLoad | None
    _shared: _Sums  # the unlabelled series, summed once
    _own: dict[int, list[tuple[str, Any]]]  # each rank's labelled samples

    def rank_load(self, rank: int) -> ScrapedLoad:
        """That rank's series and the unlabelled ones (a rank the page lacks: those alone);
        computed when asked, so a page labelling ranks nobody routes to costs nothing more."""
        sums = self._shared.copy()
        sums.add(self._own.get(rank, ()))
        return sums.load(self._lora)


def parse_page(text: str, engine: EngineKind) -> ScrapedPage:
    families = _FAMILIES[engine]
    lora: list[Any] | None = None
    items: list[tuple[str, Any]] = []
    for family in text_string_to_metric_families(_wanted_lines(text, tuple(families))):
        field = families.get(family.name)
        if field == "lora":  # read whole: the latest of its samples wins
            lora = family.samples
        elif field is not None:
            items.extend((field, sample) for sample in family.samples)
    shared: list[tuple[str, Any]] = []
    own: dict[int, list[tuple[str, Any]]] = {}
    ranks: set[int] = set()
    for field, sample in items:
        label = sample.labels.get("engine")
        if label is None:
            shared.append((field, sample))
        elif (rank := _rank(label)) is not None:
            own.setdefault(rank, []).append((field, sample))
            if field in _PER_RANK:
                ranks.add(rank)
    lora_now = lora_load(lora) if lora is not None else None
    total, unlabelled = _Sums(), _Sums()
    total.add(items)
    unlabelled.add(shared)
    return ScrapedPage(total.load(lora_now), frozenset(ranks), lora_now, unlabelled, own)


def parse_engine_metrics(text: str, engine: EngineKind, rank: str | None = None) -> ScrapedLoad:
    """The replica's load (sums across label sets: several models or engines behind one port
    add up); ``rank``: only that data-parallel rank's series (``engine="<rank>"``) and the
    unlabelled ones."""
    page = parse_page(text, engine)
    return page.load if rank is None else page.rank_load(int(rank))


class _Sums:
    """The load fields summed over samples, as a page's series add up (utilisation: the max)."""

    __slots__ = ("block_size", "legacy_kv", "num_blocks", "sums")

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.legacy_kv: float | None = None
        self.block_size: int | None = None
        self.num_blocks: int | None = None

    def copy(self) -> _Sums:
        other = _Sums()
        other.sums = dict(self.sums)
        other.legacy_kv, other.block_size, other.num_blocks = self.legacy_kv, self.block_size, self.num_blocks
        return other

    def add(self, items: Iterable[tuple[str, Any]]) -> None:
        sums = self.sums
        for field, sample in items:
            limit = _MAX_COUNTER if field == "restart_marker" else _MAX_GAUGE
            if field != "cache_config" and not 0 <= sample.value <= limit:
                continue  # NaN/Inf, negative or absurd: "not reported", never a load value
            if field == "cache_config":
                self.block_size = _int_label(sample.labels, "block_size", MAX_BLOCK_SIZE)
                self.num_blocks = _int_label(sample.labels, "num_gpu_blocks", int(_MAX_GAUGE))
            elif field == "kv_usage":
                # Utilisation is a fraction: take the max over engines, not a sum.
                sums[field] = max(sums.get(field, 0.0), sample.value)
            elif field == "kv_usage_legacy":
                self.legacy_kv = max(self.legacy_kv or 0.0, sample.value)
            elif field == "restart_marker":
                if sample.name.endswith("_total"):
                    sums[field] = sums.get(field, 0.0) + sample.value
            else:
                sums[field] = sums.get(field, 0.0) + sample.value

    def load(self, lora: LoraLoad | None) -> ScrapedLoad:
        sums = self.sums
        return ScrapedLoad(
            waiting=sums.get("waiting"),
            running=sums.get("running"),
            kv_usage=sums.get("kv_usage", self.legacy_kv),
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            restart_marker=sums.get("restart_marker"),
            lora=lora,
        )
