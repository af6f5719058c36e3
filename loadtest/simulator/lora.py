"""vLLM's LoRA serving as the scheduler, the metric and ``/v1/models`` show it.

What vLLM 0.32 does and this models (``--enable-lora --max-loras N --lora-modules a=PATH``):

- a request names an adapter as its ``model``; ``/v1/models`` lists each adapter with
  ``parent`` = the base model; ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``
  add and remove adapters at run time;
- a batch holds at most ``max_loras`` distinct adapters: a waiting request for another one is
  skipped (it waits) while the running ones fill the slots (v1 scheduler);
- an adapter not resident in the GPU slots is loaded before the step that first runs it, the
  least recently used one evicted when the slots are full: ``lora_load_ms`` per load (a
  modelled cost: loading from host memory takes milliseconds, from disk tens to hundreds);
- prefix-cache blocks are keyed by the adapter (its name seeds the block-hash chain);
- ``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`` is set
  to the current time on every engine step; each label set stays exported, the newest value
  is the current one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import xxhash
from aiohttp import web
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .wire import error_response

if TYPE_CHECKING:
    from .config import SimConfig
    from .engine import SimRequest

__all__ = ["LoraAdapters", "LoraSlots", "parse_modules"]

_INFO = "vllm:lora_requests_info"
_MAX_SERIES = 1024


def parse_modules(specs: Iterable[str]) -> dict[str, str]:
    """``name=path`` (or a bare name: its path is its name) → {name: path}."""
    modules: dict[str, str] = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not name:
            raise ValueError(f"--lora-modules: {spec!r} is not name=path")
        modules[name] = path or name
    return modules


def lora_root(name: str | None) -> int | None:
    """The block-hash chain's seed for an adapter's requests (None: the base model's)."""
    return None if name is None else xxhash.xxh3_64_intdigest(name.encode())


class LoraSlots:
    """One engine's GPU adapter slots (LRU) and what loading into them costs."""

    def __init__(self, adapters: LoraAdapters) -> None:
        self.adapters = adapters
        self.capacity = adapters.max_loras
        self.resident: OrderedDict[str, None] = OrderedDict()
        self.loads = 0
        self.evictions = 0

    def scheduled(self, running: Sequence[SimRequest]) -> set[str]:
        return {r.lora for r in running if r.lora is not None}

    def can_join(self, lora: str | None, scheduled: set[str]) -> bool:
        return lora is None or lora in scheduled or len(scheduled) < self.capacity

    def step_us(self, batch: Iterable[SimRequest], waiting: Iterable[SimRequest]) -> float:
        """Load cost of this step's adapters not resident; records the metric's label set."""
        running = {r.lora for r in batch if r.lora is not None}
        cost = 0.0
        for name in running:
            if name in self.resident:
                self.resident.move_to_end(name)
                continue
            if len(self.resident) >= self.capacity:
                self.resident.popitem(last=False)
                self.evictions += 1
            self.resident[name] = None
            self.loads += 1
            cost += self.adapters.load_ms * 1000
        self.adapters.observe(running, {r.lora for r in waiting if r.lora is not None})
        return cost

    def forget(self, name: str) -> None:
        self.resident.pop(name, None)


class LoraAdapters:
    """A replica's adapters (static and loaded at run time), its metric and its HTTP routes."""

    def __init__(self, config: SimConfig) -> None:
        self.base_model = config.model
        self.max_loras = config.max_loras
        self.load_ms = config.lora_load_ms
        self.modules = parse_modules(config.lora_modules)
        self.slots: list[LoraSlots] = []
        # (running, waiting) label values -> when last set (vLLM's gauge keeps every label set).
        self.series: dict[tuple[str, str], float] = {}

    def attach(self, engine: Any) -> None:
        engine.lora = slots = LoraSlots(self)
        self.slots.append(slots)

    def serves(self, model: str) -> bool:
        return model in self.modules

    def assign(self, req: SimRequest, model: str | None) -> None:
        """Mark ``req`` as running ``model``'s adapter (no-op for the base model)."""
        if model is not None and model in self.modules:
            req.lora = model
            req.blocks.root = lora_root(model)
            req.blocks.lora = model

    def observe(self, running: set[str], waiting: set[str]) -> None:
        key = (",".join(sorted(running)), ",".join(sorted(waiting)))
        self.series.pop(key, None)
        self.series[key] = time.time()
        if len(self.series) > _MAX_SERIES:  # vLLM keeps all; a long benchmark must not grow forever
            del self.series[next(iter(self.series))]

    def cards(self, created: int) -> list[dict[str, Any]]:
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": path,
                "parent": self.base_model,
                "max_model_len": None,
                "permission": [],
            }
            for name, path in self.modules.items()
        ]

    def stats(self) -> dict[str, Any]:
        return {
            "adapters": sorted(self.modules),
            "max_loras": self.max_loras,
            "loads": sum(s.loads for s in self.slots),
            "evictions": sum(s.evictions for s in self.slots),
            "resident": [list(s.resident) for s in self.slots],
        }

    # ---- HTTP: vLLM's run-time adapter routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) ---------
    async def load(self, request: web.Request) -> web.Response:
        body = await _json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            msg = "Both 'lora_name' and 'lora_path' must be provided."
            return error_response(400, msg, "BadRequestError")
        if name in self.modules:
            msg = f"The lora adapter '{name}' has already been loaded."
            return error_response(400, msg, "BadRequestError")
        self.modules[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await _json(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in self.modules:
            return error_response(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.modules[name]
        for slots in self.slots:
            slots.forget(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class LoraCollector(Collector):
    """``vllm:lora_requests_info``: every label set it had, valued by when it was last set."""

    def __init__(self, adapters: LoraAdapters) -> None:
        self.adapters = adapters

    def collect(self) -> Iterator[Metric]:
        names = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
        gauge = GaugeMetricFamily(_INFO, "Running stats on lora requests.", labels=names)
        max_lora = str(self.adapters.max_loras)
        for (running, waiting), when in list(self.adapters.series.items()):
            gauge.add_metric([max_lora, running, waiting], when)
        yield gauge
