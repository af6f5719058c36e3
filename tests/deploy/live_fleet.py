"""Pieces of the live-Prometheus test: restartable simulated replicas, light steady load, keys files."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gateway.auth import hash_key
from loadtest.simulator import RunningSimulator, SimConfig, running_simulator

__all__ = ["KEY_OK", "KEY_TINY", "Load", "Replica", "ResponsesLoad", "write_keys"]

KEY_OK = "sk-live-ok"
KEY_TINY = "sk-live-tiny"  # one request per minute: its second request is rate limited


def write_keys(path: Path) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "tenants": {
                    "ok": {"requests_per_minute": 100_000, "tokens_per_minute": 100_000_000},
                    "tiny": {"requests_per_minute": 1, "tokens_per_minute": 100_000},
                },
                "keys": [
                    {"sha256": hash_key(KEY_OK), "tenant": "ok", "name": "ok"},
                    {"sha256": hash_key(KEY_TINY), "tenant": "tiny", "name": "tiny"},
                ],
            }
        )
    )
    return path


class Replica:
    """A simulator that can be killed (its listener closed: connections refused) and restarted on its port."""

    def __init__(self, **config: Any) -> None:
        config.setdefault("time_scale", 50.0)
        config.setdefault("model", "m")
        self._config = config
        self.port = 0
        self._cm: contextlib.AbstractAsyncContextManager[RunningSimulator] | None = None
        self.sim: RunningSimulator | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> Replica:
        self._cm = running_simulator(SimConfig(port=self.port, **self._config))
        self.sim = await self._cm.__aenter__()
        self.port = int(self.sim.url.rsplit(":", 1)[1])
        return self

    async def stop(self) -> None:
        cm, self._cm, self.sim = self._cm, None, None
        if cm is not None:
            await cm.__aexit__(None, None, None)

    async def fault(self, http: aiohttp.ClientSession, mode: str, **extra: Any) -> None:
        async with http.post(self.url + "/admin/fault", json={"mode": mode, **extra}) as resp:
            resp.raise_for_status()


class Load:
    """``workers`` loops each sending one request, then pausing ``pause_s``; statuses counted per phase."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        url: str,
        *,
        pause_s: float = 0.25,
        workers: int = 1,
        request: Callable[[int], tuple[dict[str, Any], dict[str, str]]] | None = None,
    ) -> None:
        self._http = http
        self._url = url + "/v1/chat/completions"
        self._pause_s = pause_s
        self._workers = workers
        self._request = request or plain_request
        self._tasks: list[asyncio.Task[None]] = []
        self._seq = itertools.count()
        self.phase = "baseline"
        self.statuses: dict[str, Counter[int]] = {}

    def start(self) -> Load:
        self._tasks = [asyncio.create_task(self._run()) for _ in range(self._workers)]
        return self

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def count(self, low: int, high: int, phase: str | None = None) -> int:
        phases = [phase] if phase else list(self.statuses)
        return sum(n for p in phases for s, n in self.statuses.get(p, Counter()).items() if low <= s < high)

    async def _run(self) -> None:
        while True:
            body, headers = self._request(next(self._seq))
            started = time.monotonic()
            try:
                async with self._http.post(self._url, json=body, headers=headers) as resp:
                    await resp.read()
                    status = resp.status
            except (aiohttp.ClientError, TimeoutError):
                status = 599  # a transport failure, counted with the 5xx
            self.statuses.setdefault(self.phase, Counter())[status] += 1
            await asyncio.sleep(max(0.0, self._pause_s - (time.monotonic() - started) / 4))


class ResponsesLoad(Load):
    """Responses chains of three steps (each continuing the last by ``previous_response_id``),
    as tenant ``ok``: the stored-response lookups, and a 409 once a chain's replica has left."""

    def __init__(self, http: aiohttp.ClientSession, url: str, *, pause_s: float = 0.5) -> None:
        super().__init__(http, url, pause_s=pause_s)
        self._url = url + "/v1/responses"
        self._previous: str | None = None

    async def _run(self) -> None:
        step = 0
        while True:
            body: dict[str, Any] = {"model": "m", "input": f"step {step}", "max_output_tokens": 4}
            if self._previous and step % 3:
                body["previous_response_id"] = self._previous
            headers = {"authorization": f"Bearer {KEY_OK}"}
            try:
                async with self._http.post(self._url, json=body, headers=headers) as resp:
                    answer = await resp.json(content_type=None)
                    status = resp.status
            except (aiohttp.ClientError, TimeoutError, ValueError):
                status, answer = 599, None
            ok = status == 200 and isinstance(answer, dict)
            self._previous = answer.get("id") if ok else None
            step = step + 1 if ok else 0  # a failed step starts a new chain
            self.statuses.setdefault(self.phase, Counter())[status] += 1
            await asyncio.sleep(self._pause_s)


_TOPICS = ["billing", "shipping", "returns", "warranty"]


def plain_request(i: int) -> tuple[dict[str, Any], dict[str, str]]:
    """A chat with a shared system prompt (prefix hits), a session id, streamed every other time."""
    topic = _TOPICS[i % len(_TOPICS)]
    body: dict[str, Any] = {
        "model": "m",
        "messages": [
            {"role": "system", "content": f"You are the {topic} assistant of a large shop. " * 8},
            {"role": "user", "content": f"question {i % 7} about {topic}"},
        ],
        "max_tokens": 8,
    }
    if i % 2:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body, {"x-session-id": f"s-{i % 5}"}


def tenant_request(i: int) -> tuple[dict[str, Any], dict[str, str]]:
    """``plain_request`` as tenant ``ok``; of every ten, one as ``tiny`` (rate limited), one with a bad
    key (401), one the engine refuses (400), one long unique prompt."""
    body, headers = plain_request(i)
    key = KEY_TINY if i % 10 == 0 else "sk-not-a-key" if i % 10 == 5 else KEY_OK
    if i % 10 == 3:
        body["max_tokens"] = 10**6  # beyond max_model_len: the engine's own 400, passed through
    if i % 10 == 7:  # a long unique prompt that evicts the small KV cache: the next hits are mispredicted
        body["messages"] = [{"role": "user", "content": f"{i} " + "lorem ipsum dolor sit amet " * 160}]
    return body, {**headers, "authorization": f"Bearer {key}"}


def long_request(i: int) -> tuple[dict[str, Any], dict[str, str]]:
    """Overload: long generations that keep the replica's batch full."""
    body = {"model": "m", "messages": [{"role": "user", "content": f"essay {i}"}], "max_tokens": 400}
    return body, {}
