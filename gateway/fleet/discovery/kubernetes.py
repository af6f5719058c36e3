"""Endpoints from the Ready pods that match a label selector: LIST, then WATCH from the list's version.

Why plain aiohttp and not ``kubernetes_asyncio``: we need two GETs on one resource and full control
of exactly the parts that decide robustness — re-reading the projected service-account token on every
(re)connect (it rotates hourly), telling a 410 Gone from a dropped stream from a quiet resync, bounding
a single event's size, and keeping the last good set on any error. The generated client puts those
behind its ``Watch`` helper, model deserialisation and config loaders, and would add a large
dependency for two requests. aiohttp is already the gateway's HTTP stack.

The cycle: LIST (authoritative: an empty list is applied), publish; WATCH with
``resourceVersion=<list rv>&allowWatchBookmarks=true`` and apply each change; re-list when the watch
says 410 Gone, when ``resync_s`` has passed (events can be missed; a re-list repairs the set), and
after the stream ends or drops. Errors back off exponentially (capped) and never touch the set.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import json
import logging
import math
import os
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

import aiohttp
from pydantic import ValidationError

from gateway.config import ConfigError, EndpointConfig, KubernetesDiscoveryConfig
from gateway.fleet.discovery.source import ApplyEndpoints, Backoff, Publisher, no_op

__all__ = [
    "BOOTSTRAP_PORT_ANNOTATION",
    "KubernetesError",
    "KubernetesSource",
    "Skip",
    "api_server_url",
    "endpoint_from_pod",
]

log = logging.getLogger(__name__)

BOOTSTRAP_PORT_ANNOTATION = "llm-gateway.io/bootstrap-port"  # SGLang prefill pods (PD disaggregation)
ROLES = frozenset({"both", "prefill", "decode"})  # ours and llm-d's ``llm-d.ai/role`` values
ENGINES = frozenset({"vllm", "sglang"})
MAX_EVENT_BYTES = 16 * 1024 * 1024  # one watch event (a pod); far above any real pod object
HEALTHY_WATCH_S = 1.0  # a watch open this long, or with an event (not an ERROR), resets the back-off
_CONNECT_S = 10.0
_LIST_TIMEOUT = aiohttp.ClientTimeout(total=30.0, connect=_CONNECT_S)
# A watch is long-lived: no total or read timeout; the resync deadline bounds it instead.
_WATCH_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=_CONNECT_S, sock_read=None)


class KubernetesError(Exception):
    """The API server answered, but with an error (HTTP status, a watch ERROR event, a bad body)."""


class Skip(NamedTuple):
    """Why a pod is not an endpoint; ``warn`` marks misconfiguration rather than a lifecycle state."""

    reason: str
    warn: bool = False


class _WatchEnd(enum.Enum):
    RESYNC = "resync"  # resync_s passed
    GONE = "gone"  # 410: our resourceVersion is too old
    CLOSED = "closed"  # the server ended the stream cleanly (timeoutSeconds)


def api_server_url(config: KubernetesDiscoveryConfig, environ: Mapping[str, str]) -> str:
    """``api_server`` if set, else the in-cluster service from the environment the kubelet injects."""
    if config.api_server:
        return config.api_server.rstrip("/")
    host = environ.get("KUBERNETES_SERVICE_HOST")
    if not host:
        raise ConfigError(
            "discovery.kubernetes.api_server: not set, and KUBERNETES_SERVICE_HOST is unset"
            " (not running in a cluster)"
        )
    port = environ.get("KUBERNETES_SERVICE_PORT", "443")
    return f"https://{_host(host)}:{port}"


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _is_ready(status: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _port(value: str | None) -> int | Skip | None:
    if value is None:
        return None
    try:
        port = int(value)
    except ValueError:
        return Skip(f"port annotation {value!r} is not a number", warn=True)
    return port if 1 <= port <= 65535 else Skip(f"port annotation {value!r} is out of range", warn=True)


def endpoint_from_pod(pod: Mapping[str, Any], config: KubernetesDiscoveryConfig) -> EndpointConfig | Skip:
    """The pod's endpoint, or why it is not one. Pure: the rules in one place, testable alone."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return Skip("terminating")
    ip = status.get("podIP")
    if not ip:
        return Skip("no pod IP yet")
    try:  # an address as the API server writes it, nothing getaddrinfo would read otherwise
        ipaddress.ip_address(ip)
    except (TypeError, ValueError):
        return Skip(f"pod IP {str(ip)[:64]!r} is not an IP address", warn=True)
    if not _is_ready(status):
        return Skip("not Ready")
    labels: dict[str, str] = dict(meta.get("labels") or {})
    annotations: Mapping[str, str] = meta.get("annotations") or {}

    port = _port(annotations.get(config.port_annotation))
    if isinstance(port, Skip):
        return port
    port = port or config.port
    if port is None:
        return Skip(f"no {config.port_annotation} annotation and no discovery port configured", warn=True)
    bootstrap_port = _port(annotations.get(BOOTSTRAP_PORT_ANNOTATION))
    if isinstance(bootstrap_port, Skip):
        return Skip(f"bootstrap {bootstrap_port.reason}", warn=True)

    role = next((labels[key] for key in config.role_labels if key in labels), "both")
    if role not in ROLES:
        return Skip(f"role {role!r} is not one of {sorted(ROLES)}", warn=True)
    engine = labels.get(config.engine_label, "vllm")
    if engine not in ENGINES:
        return Skip(f"engine {engine!r} is not one of {sorted(ENGINES)}", warn=True)
    # Label values cannot hold "/" (most model names do), so an annotation of the same key also counts.
    raw_models = labels.get(config.model_label) or annotations.get(config.model_label) or ""
    models = [m.strip() for m in raw_models.split(",") if m.strip()]

    labels["pod"] = meta.get("name", "")
    try:
        return EndpointConfig(
            url=f"{config.scheme}://{_host(ip)}:{port}",
            models=models,
            role=role,  # type: ignore[arg-type]  # checked against ROLES above
            engine=engine,  # type: ignore[arg-type]
            labels=labels,
            bootstrap_port=bootstrap_port,
        )
    except ValidationError as exc:
        return Skip(f"invalid endpoint: {exc.errors()[0]['msg']}", warn=True)


async def _lines(stream: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """Newline-delimited events, without aiohttp's ``readline`` limit (512 KiB; etcd allows 1.5 MiB)."""
    buffer = bytearray()
    scanned = 0
    async for chunk in stream.iter_any():
        buffer += chunk
        while (newline := buffer.find(b"\n", scanned)) >= 0:
            line = bytes(buffer[:newline])
            del buffer[: newline + 1]
            scanned = 0
            if line.strip():
                yield line
        scanned = len(buffer)
        if scanned > MAX_EVENT_BYTES:
            raise KubernetesError(f"watch event larger than {MAX_EVENT_BYTES} bytes")
    if buffer.strip():
        yield bytes(buffer)


async def _body(resp: aiohttp.ClientResponse) -> Any:
    """The JSON body, or its text when it is not JSON (a proxy's error page), so errors keep the status."""
    text = await resp.text()
    try:
        return json.loads(text)
    except ValueError:
        return text


def _status_message(status: int, body: Any, namespace: str) -> str:
    message = body.get("message") if isinstance(body, dict) else None
    text = f"HTTP {status}: {message or body!r}"[:500]
    if status in (401, 403):
        text += f" (the service account needs get/list/watch on pods in namespace {namespace!r})"
    return text


class KubernetesSource:
    """One namespace + label selector → the Ready pods' endpoints. See the module docstring."""

    def __init__(
        self,
        config: KubernetesDiscoveryConfig,
        *,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._config = config
        base = api_server_url(config, os.environ if environ is None else environ)
        self._pods_url = f"{base}/api/v1/namespaces/{quote(config.namespace, safe='')}/pods"
        self._https = base.startswith("https://")
        self.name = f"kubernetes:{config.namespace}/{config.label_selector}"
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._endpoints: dict[str, EndpointConfig] = {}  # pod name → endpoint (eligible pods only)
        self._skipped: dict[str, str] = {}  # pod name → last logged reason, so each is logged once
        self._watch_healthy = False
        self._token_warned = False
        self.on_failure: Callable[[], None] = no_op

    async def run(self, apply: ApplyEndpoints) -> None:
        publisher = Publisher(self.name, apply)
        session: aiohttp.ClientSession | None = None
        try:
            while True:
                self._watch_healthy = False
                end: _WatchEnd | None = None
                try:
                    if session is None:
                        session = self._new_session()
                    end = await self._sync(session, publisher)
                except Exception as exc:
                    log.warning(
                        "%s: %s; keeping %d endpoints", self.name, _describe(exc), len(publisher.last or [])
                    )
                    self.on_failure()
                if self._watch_healthy:
                    self._backoff.reset()
                # A watch that ends at once (closed, or 410 right after the list) is a failure too:
                # never re-list in a hot loop.
                if end is None or (end is not _WatchEnd.RESYNC and not self._watch_healthy):
                    await asyncio.sleep(self._backoff.next())
        finally:
            if session is not None:
                await session.close()

    # ---- one LIST + WATCH cycle ----------------------------------------------------------
    async def _sync(self, session: aiohttp.ClientSession, publisher: Publisher) -> _WatchEnd:
        deadline = asyncio.get_running_loop().time() + self._config.resync_s
        version = await self._list(session)
        publisher.publish(list(self._endpoints.values()))
        return await self._watch(session, version, deadline, publisher)

    async def _list(self, session: aiohttp.ClientSession) -> str:
        params = {"labelSelector": self._config.label_selector} if self._config.label_selector else {}
        async with session.get(
            self._pods_url, params=params, headers=self._headers(), timeout=_LIST_TIMEOUT
        ) as resp:
            body = await _body(resp)
            if resp.status != 200:
                raise KubernetesError(
                    "list pods: " + _status_message(resp.status, body, self._config.namespace)
                )
        try:
            version = str(body["metadata"]["resourceVersion"])
            pods = body.get("items") or []
        except (KeyError, TypeError) as exc:
            raise KubernetesError(f"list pods: not a PodList ({exc!r})") from exc
        endpoints: dict[str, EndpointConfig] = {}
        for pod in pods:
            self._update(pod, endpoints)
        self._endpoints = endpoints  # swapped whole: a bad item above leaves the last good set intact
        names = {str((pod.get("metadata") or {}).get("name", "")) for pod in pods}
        self._skipped = {name: why for name, why in self._skipped.items() if name in names}
        return version

    async def _watch(
        self, session: aiohttp.ClientSession, version: str, deadline: float, publisher: Publisher
    ) -> _WatchEnd:
        params = {
            "watch": "1",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            # The server ends the stream near our resync time, so it holds no watch we abandoned.
            "timeoutSeconds": str(max(1, math.ceil(self._config.resync_s))),
        }
        if self._config.label_selector:
            params["labelSelector"] = self._config.label_selector
        opened: float | None = None
        events = 0
        scope = asyncio.timeout_at(deadline)
        try:
            async with scope:
                async with session.get(
                    self._pods_url, params=params, headers=self._headers(), timeout=_WATCH_TIMEOUT
                ) as resp:
                    if resp.status == 410:
                        return _WatchEnd.GONE
                    if resp.status != 200:
                        body = await _body(resp)
                        raise KubernetesError(
                            "watch pods: " + _status_message(resp.status, body, self._config.namespace)
                        )
                    opened = time.monotonic()
                    async for line in _lines(resp.content):
                        if self._handle(json.loads(line)) is _WatchEnd.GONE:
                            log.info("%s: watch expired (410 Gone); re-listing", self.name)
                            return _WatchEnd.GONE
                        events += 1
                        publisher.publish(list(self._endpoints.values()))
            return _WatchEnd.CLOSED
        except TimeoutError:
            if scope.expired():
                return _WatchEnd.RESYNC
            raise
        finally:
            lived = opened is not None and time.monotonic() - opened >= HEALTHY_WATCH_S
            self._watch_healthy = events > 0 or lived

    def _handle(self, event: Any) -> _WatchEnd | None:
        kind = event.get("type") if isinstance(event, dict) else None
        obj = event.get("object") if isinstance(event, dict) else None
        if not isinstance(obj, dict):
            raise KubernetesError(f"malformed watch event: {str(event)[:200]}")
        if kind in ("ADDED", "MODIFIED"):
            self._update(obj, self._endpoints)
        elif kind == "DELETED":
            name = (obj.get("metadata") or {}).get("name", "")
            self._endpoints.pop(name, None)
            self._skipped.pop(name, None)
        elif kind == "ERROR":
            if obj.get("code") == 410:
                return _WatchEnd.GONE
            raise KubernetesError(f"watch error {obj.get('code')}: {obj.get('message')}")
        elif kind != "BOOKMARK":
            log.debug("%s: ignoring watch event type %r", self.name, kind)
        return None

    def _update(self, pod: Mapping[str, Any], endpoints: dict[str, EndpointConfig]) -> None:
        """Put one pod's current state into ``endpoints`` (in or out); log a skip once per reason."""
        name = str((pod.get("metadata") or {}).get("name", ""))
        result = endpoint_from_pod(pod, self._config)
        if isinstance(result, EndpointConfig):
            endpoints[name] = result
            self._skipped.pop(name, None)
            return
        endpoints.pop(name, None)
        if self._skipped.get(name) != result.reason:
            self._skipped[name] = result.reason
            level = logging.WARNING if result.warn else logging.DEBUG
            log.log(level, "%s: pod %s is not an endpoint: %s", self.name, name, result.reason)

    # ---- connection ----------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        """Re-read the token each time: projected service-account tokens rotate under us."""
        headers = {"Accept": "application/json"}
        try:
            token = Path(self._config.token_file).read_text().strip()
        except OSError as exc:
            if not self._token_warned:
                log.warning("%s: no bearer token (%s); sending none", self.name, exc)
                self._token_warned = True
            return headers
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _new_session(self) -> aiohttp.ClientSession:
        tls: ssl.SSLContext | bool = True
        ca_file = self._config.ca_file
        if self._https and ca_file:
            if Path(ca_file).exists():
                tls = ssl.create_default_context(cafile=ca_file)
            else:
                log.warning("%s: CA file %s not found; verifying with the system CAs", self.name, ca_file)
        # One LIST or WATCH at a time; two connections leave room for a LIST while a WATCH closes.
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls, limit=2))


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
