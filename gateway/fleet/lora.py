"""LoRA adapters on a replica: which it serves, and which are in use right now.

Served: vLLM lists each adapter in ``/v1/models`` as its own model with ``parent`` set to the
base model (static ``--lora-modules`` and adapters loaded at run time through
``/v1/load_lora_adapter`` alike), read by :func:`adapter_parents`.

In use: vLLM reports it in one gauge,
``vllm:lora_requests_info{running_lora_adapters="a,b",waiting_lora_adapters="c",max_lora="4"}``,
whose *value* is the time it was last set. Every label set it ever had stays exported, so the
sample with the largest value is the current one (the Gateway API Inference Extension reads
it the same way); :func:`lora_load` turns those samples into a :class:`LoraLoad`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.samples import Sample

__all__ = ["LORA_METRIC", "LoraLoad", "adapter_parents", "lora_load"]

LORA_METRIC = "vllm:lora_requests_info"
_MAX_NAMES = 4096  # a hostile or broken engine's label must not become an unbounded set
_MAX_NAME_LEN = 512


@dataclass(frozen=True, slots=True)
class LoraLoad:
    """Adapters with running / waiting requests and the batch's adapter limit (``--max-loras``)."""

    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_lora: int | None = None

    def has_free_slot(self, also: Iterable[str] = ()) -> bool:
        """Another adapter can join the batch without one of these (or ``also``) leaving it."""
        return self.max_lora is not None and len(self.running | self.waiting | set(also)) < self.max_lora


def _names(value: str | None) -> frozenset[str]:
    if not value:
        return frozenset()
    names = (n.strip() for n in value.split(",", _MAX_NAMES)[:_MAX_NAMES])
    return frozenset(n for n in names if n and len(n) <= _MAX_NAME_LEN)


def _max_lora(labels: dict[str, str]) -> int | None:
    raw = labels.get("max_lora", labels.get("max_loras"))
    try:
        value = int(raw) if raw is not None else None
    except ValueError:
        return None
    return value if value is not None and value >= 0 else None


def lora_load(samples: Iterable[Sample]) -> LoraLoad | None:
    """The latest sample of ``vllm:lora_requests_info`` (largest value), parsed; None without one."""
    latest: Sample | None = None
    for sample in samples:
        if math.isfinite(sample.value) and (latest is None or sample.value > latest.value):
            latest = sample
    if latest is None:
        return None
    labels = latest.labels
    return LoraLoad(
        running=_names(labels.get("running_lora_adapters")),
        waiting=_names(labels.get("waiting_lora_adapters")),
        max_lora=_max_lora(labels),
    )


def adapter_parents(payload: object) -> dict[str, str]:
    """Adapter → base model, from the entries of a ``/v1/models`` answer that name a ``parent``.

    The base model's own entry has ``parent: null``; anything else malformed is skipped (the
    model ids themselves are checked by the health checker's parser).
    """
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return {}
    parents: dict[str, str] = {}
    for item in data[:_MAX_NAMES]:
        if not isinstance(item, dict):
            continue
        model, parent = item.get("id"), item.get("parent")
        if isinstance(model, str) and isinstance(parent, str) and parent and parent != model:
            parents[model] = parent
    return parents
