"""``/metrics`` of the whole gateway with several workers: every worker's series, one scrape.

Why: Prometheus scrapes one connection, which the kernel hands to one worker; each worker's
counters and histograms cover only the requests it served, so a scrape showed a random
worker's share. Here each worker also serves its own exposition on a unix socket in the
gateway's private directory, and the worker answering ``/metrics`` gathers its siblings'
(1 s budget each) and answers with all of them, each series labelled ``worker="<index>"``
— what ``sum without (worker) (...)`` adds up, as prometheus_client's multiprocess mode
would. A sibling that does not answer in time is left out of that scrape (logged). The load
gauges (in-flight, pending prefill) are the shared sums in every worker: take ``max``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["MetricsShare"]

log = logging.getLogger(__name__)

_TIMEOUT_S = 1.0


class _Families:
    """A collector that hands back already-built families (for ``generate_latest``)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


class MetricsShare:
    def __init__(self, registry: CollectorRegistry, directory: str, worker: int, workers: int) -> None:
        self._registry = registry
        self._worker = worker
        self._paths = {w: os.path.join(directory, f"metrics-{w}.sock") for w in range(workers)}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        """Serve this worker's own exposition to its siblings."""

        async def serve(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                writer.write(generate_latest(self._registry))
                await writer.drain()
            writer.close()

        path = self._paths[self._worker]
        if os.path.exists(path):
            os.unlink(path)
        self._server = await asyncio.start_unix_server(serve, path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def exposition(self) -> bytes:
        """Every worker's series, labelled by worker, in the text format."""
        siblings = [w for w in self._paths if w != self._worker]
        texts = await asyncio.gather(*(self._fetch(w) for w in siblings))
        parts = {self._worker: generate_latest(self._registry).decode()}
        parts.update({w: t for w, t in zip(siblings, texts, strict=True) if t is not None})
        merged: dict[str, Metric] = {}
        for worker, text in sorted(parts.items()):
            for family in text_string_to_metric_families(text):
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type)
                for sample in family.samples:
                    labels = {**sample.labels, "worker": str(worker)}
                    into.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(list(merged.values())))
        return generate_latest(registry)

    async def _fetch(self, worker: int) -> str | None:
        try:
            async with asyncio.timeout(_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(self._paths[worker])
                try:
                    return (await reader.read()).decode()
                finally:
                    writer.close()
        except (OSError, TimeoutError) as exc:
            log.warning("/metrics: worker %d left out of this scrape: %s", worker, exc)
            return None
