"""A small Kubernetes API server for pods, speaking the real wire protocol on 127.0.0.1.

``GET /api/v1/namespaces/{ns}/pods?labelSelector=…`` answers a PodList with the store's
resourceVersion; with ``watch=1&resourceVersion=N`` it streams newline-delimited watch events over
chunked transfer encoding: first every stored change after N, then each change as the test makes it.
Like the real cacher, a label-selector watch sees ADDED when a pod starts matching, MODIFIED while it
matches, DELETED when it stops matching or is deleted. ``timeoutSeconds`` ends the stream cleanly.

Test controls: ``put``/``delete`` (``notify=False`` loses the event, as a missed one would be),
``expire`` (410 Gone to every watch, and older versions stay expired), ``drop`` (abort the TCP
connection mid-stream), ``close`` (clean end of stream), ``send_raw`` (a recorded event line),
``bookmark``, ``list_status`` (answer LIST with that error status).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["FakeApiServer", "Seen", "make_pod", "running_apiserver"]

Labels = dict[str, str]
_DROP, _CLOSE, _GONE = object(), object(), object()


def make_pod(
    name: str,
    ip: str | None = "10.244.0.10",
    *,
    ready: bool = True,
    labels: Labels | None = None,
    annotations: dict[str, str] | None = None,
    deleting: bool = False,
    namespace: str = "llm",
) -> dict[str, Any]:
    """A pod object shaped like the API server's (the fields discovery reads, and their neighbours)."""
    status: dict[str, Any] = {
        "phase": "Running" if ip else "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2025-05-01T10:00:00Z"},
            {"type": "Initialized", "status": "True", "lastTransitionTime": "2025-05-01T10:00:02Z"},
            {"type": "ContainersReady", "status": str(ready), "lastTransitionTime": "2025-05-01T10:01:30Z"},
            {"type": "Ready", "status": str(ready), "lastTransitionTime": "2025-05-01T10:01:30Z"},
        ],
        "hostIP": "192.168.10.4",
        "startTime": "2025-05-01T10:00:00Z",
    }
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": f"uid-{name}",
        "creationTimestamp": "2025-05-01T10:00:00Z",
        "labels": {"app": "vllm", **(labels or {})},
        "annotations": dict(annotations or {}),
    }
    if deleting:
        metadata["deletionTimestamp"] = "2025-05-01T11:00:00Z"
        metadata["deletionGracePeriodSeconds"] = 30
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": metadata,
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.9.0"}], "nodeName": "gpu-1"},
        "status": status,
    }


def _selector(text: str) -> Callable[[Labels], bool]:
    """Equality-based selectors: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k`` (comma = AND)."""
    tests: list[Callable[[Labels], bool]] = []
    for term in (t.strip() for t in text.split(",")):
        if not term:
            continue
        if "!=" in term:
            key, value = term.split("!=", 1)
            tests.append(lambda labels, k=key, v=value: labels.get(k) != v)
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            tests.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif term.startswith("!"):
            tests.append(lambda labels, k=term[1:]: k not in labels)
        else:
            tests.append(lambda labels, k=term: k in labels)
    return lambda labels: all(test(labels) for test in tests)


def _labels(pod: dict[str, Any] | None) -> Labels:
    return (pod or {}).get("metadata", {}).get("labels") or {}


@dataclass
class Seen:
    """One request the server received."""

    watch: bool
    query: dict[str, str]
    authorization: str | None
    at: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Watch:
    matches: Callable[[Labels], bool]
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)


class FakeApiServer:
    def __init__(self, namespace: str = "llm") -> None:
        self.namespace = namespace
        self.pods: dict[str, dict[str, Any]] = {}
        self.version = 1000
        self.compacted = 0  # watches from a version below this get 410 Gone
        self.history: list[tuple[int, dict[str, Any] | None, dict[str, Any] | None]] = []
        self.list_status = 200
        self.honour_timeout = True  # False: watches never end on their own (``timeoutSeconds`` ignored)
        self.requests: list[Seen] = []
        self.url = ""
        self._watches: set[_Watch] = set()
        self._activity = asyncio.Event()
        self._runner: web.AppRunner | None = None

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self, ssl_context: ssl.SSLContext | None = None, port: int = 0) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, ssl_context=ssl_context)
        await site.start()
        scheme = "https" if ssl_context else "http"
        self.url = f"{scheme}://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        self.close()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # ---- what the test sees -------------------------------------------------------------
    @property
    def lists(self) -> list[Seen]:
        return [r for r in self.requests if not r.watch]

    @property
    def watches(self) -> list[Seen]:
        return [r for r in self.requests if r.watch]

    @property
    def watching(self) -> int:
        return len(self._watches)

    async def wait_until(self, check: Callable[[], bool], within_s: float = 3.0) -> None:
        """Until ``check()`` holds, re-checked on every request and every watch opened."""
        async with asyncio.timeout(within_s):
            while not check():
                self._activity.clear()
                await self._activity.wait()

    async def wait_watching(self, watch_requests: int = 1, within_s: float = 3.0) -> None:
        """Until at least ``watch_requests`` watches were made and one is open now."""
        await self.wait_until(lambda: len(self.watches) >= watch_requests and bool(self._watches), within_s)

    async def wait_lists(self, count: int, within_s: float = 5.0) -> None:
        await self.wait_until(lambda: len(self.lists) >= count, within_s)

    # ---- what the test changes ------------------------------------------------------------
    def put(self, pod: dict[str, Any], notify: bool = True) -> None:
        name = pod["metadata"]["name"]
        self.version += 1
        new = copy.deepcopy(pod)
        new["metadata"]["resourceVersion"] = str(self.version)
        old = self.pods.get(name)
        self.pods[name] = new
        if notify:
            self._publish(old, new)

    def delete(self, name: str, notify: bool = True) -> None:
        old = self.pods.pop(name)
        self.version += 1
        if notify:
            self._publish(old, None)

    def expire(self) -> None:
        self.compacted = self.version
        self._push(_GONE)

    def drop(self) -> None:
        self._push(_DROP)

    def close(self) -> None:
        self._push(_CLOSE)

    def send_raw(self, line: bytes) -> None:
        self._push(line.rstrip(b"\n") + b"\n")

    def bookmark(self) -> None:
        event = {"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1"}}
        event["object"]["metadata"] = {"resourceVersion": str(self.version)}
        self._push(json.dumps(event).encode() + b"\n")

    def _publish(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        entry = (self.version, old, new)
        self.history.append(entry)
        self._push(entry)

    def _push(self, item: Any) -> None:
        for watch in self._watches:
            watch.queue.put_nowait(item)

    # ---- the API -------------------------------------------------------------------------
    async def _pods(self, request: web.Request) -> web.StreamResponse:
        watch = request.query.get("watch") in ("1", "true")
        self.requests.append(Seen(watch, dict(request.query), request.headers.get("Authorization")))
        self._activity.set()
        if request.match_info["namespace"] != self.namespace:
            return self._status(404, "NotFound", "namespaces not found")
        matches = _selector(request.query.get("labelSelector", ""))
        if watch:
            return await self._watch(request, matches)
        if self.list_status != 200:
            return self._status(self.list_status, "InternalError", "the server is having a bad day")
        items = [p for p in self.pods.values() if matches(_labels(p))]
        metadata = {"resourceVersion": str(self.version)}
        return web.json_response(
            {"kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": items}
        )

    @staticmethod
    def _status(code: int, reason: str, message: str) -> web.Response:
        body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message}
        return web.json_response({**body, "reason": reason, "code": code}, status=code)

    async def _watch(self, request: web.Request, matches: Callable[[Labels], bool]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        since = int(request.query.get("resourceVersion") or 0)
        if since < self.compacted:
            await self._write_gone(resp, since)
            return resp
        watch = _Watch(matches)
        self._watches.add(watch)  # registered and snapshotted with no await between: nothing is lost
        backlog = [entry for entry in self.history if entry[0] > since]
        self._activity.set()
        try:
            limit = float(request.query.get("timeoutSeconds", 3600)) if self.honour_timeout else None
            async with asyncio.timeout(limit):
                for entry in backlog:
                    await self._write_change(resp, watch, entry)
                while True:
                    item = await watch.queue.get()
                    if item is _DROP:
                        assert request.transport is not None
                        request.transport.abort()
                        return resp
                    if item is _CLOSE:
                        break
                    if item is _GONE:
                        await self._write_gone(resp, since)
                        return resp
                    if isinstance(item, bytes):
                        await resp.write(item)
                    else:
                        await self._write_change(resp, watch, item)
        except TimeoutError:
            pass
        finally:
            self._watches.discard(watch)
        await resp.write_eof()
        return resp

    @staticmethod
    async def _write_change(resp: web.StreamResponse, watch: _Watch, entry: tuple[int, Any, Any]) -> None:
        _, old, new = entry
        was, now = (
            old is not None and watch.matches(_labels(old)),
            new is not None and watch.matches(_labels(new)),
        )
        if now:
            event = {"type": "MODIFIED" if was else "ADDED", "object": new}
        elif was:
            event = {"type": "DELETED", "object": new or old}
        else:
            return
        await resp.write(json.dumps(event).encode() + b"\n")

    async def _write_gone(self, resp: web.StreamResponse, since: int) -> None:
        status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired", "code": 410}
        status["message"] = f"too old resource version: {since} ({self.compacted})"
        await resp.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
        await resp.write_eof()


@contextlib.asynccontextmanager
async def running_apiserver(
    namespace: str = "llm", ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[FakeApiServer]:
    server = FakeApiServer(namespace)
    await server.start(ssl_context)
    try:
        yield server
    finally:
        await server.stop()
