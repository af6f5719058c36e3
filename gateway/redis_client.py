"""The one factory of Redis clients: every backend (prefix index, sessions, responses, API keys,
rate limits) builds its client here, from its ``redis_url``, for one server or a Redis Cluster.

    redis://host:6379/0                      one server
    redis://host:7000?cluster=true           a Redis Cluster, through any one node's address
    redis://host:7000?cluster=true&nodes=h2:7001,h3:7002
                                             … with more seed nodes, tried when the first is down
    rediss://…                               TLS, either form (user:password@ as usual)

With ``cluster=true`` the client is :class:`redis.asyncio.cluster.RedisCluster`: it learns the
slot map from a seed (``CLUSTER SLOTS``), sends each command to the master of its key's slot,
follows ``MOVED``/``ASK`` and re-learns the map when a master fails over. A cluster has only
database 0 (a path in the URL is refused). Every multi-key command and Lua script of the
backends keeps its keys in one slot by hash tags (``{<model>}``, ``{<tenant>}``,
``{<session>}``); the few that span tags (a purge over several models) are split per slot
by the client.

A cluster client starts learning the slot map at once in the background (~0.5 s; commands
in that time wait for it within their :class:`~gateway.redis_guard.RedisGuard` budget, or
fall back); a cluster that is down at start-up costs fallbacks, never a failed start.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster

__all__ = ["RedisClient", "cluster_seeds", "is_cluster_url", "redis_client", "redis_ports"]

RedisClient = aioredis.Redis | RedisCluster

_TRUE = {"1", "true", "yes", "on"}


class _Cluster(RedisCluster):
    """``RedisCluster`` whose (re)initialisation runs in its own task, shared by its callers.

    redis-py initialises on the first command (seed nodes, ``CLUSTER SLOTS``, ``COMMAND``:
    ~0.5 s) and, if that is cancelled half-way, closes every connection and starts over. Under
    a 5 ms :class:`~gateway.redis_guard.RedisGuard` budget every caller is cancelled, so the
    client would never finish; shielded, the first caller starts it and later ones find it done.
    """

    _init_task: asyncio.Future[Any] | None = None

    async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
        if not self._initialize:
            return self
        task = self._init_task
        if task is None or task.done():
            task = self._init_task = asyncio.ensure_future(super().initialize(*args, **kwargs))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
        await asyncio.shield(task)
        return self

    def start_initializing(self) -> None:
        """Begin initialising now, in the background, when an event loop runs (else: on first use)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        asyncio.ensure_future(self.initialize()).add_done_callback(lambda t: t.cancelled() or t.exception())


def _query(url: str) -> list[tuple[str, str]]:
    return parse_qsl(urlsplit(url).query, keep_blank_values=True)


def is_cluster_url(url: str) -> bool:
    return any(k == "cluster" and v.lower() in _TRUE for k, v in _query(url))


def _host_port(text: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit("//" + text)
    if not parts.hostname:
        raise ValueError(f"redis_url: bad cluster node {text!r} (want host:port)")
    return parts.hostname, parts.port or default_port


def cluster_seeds(url: str) -> list[tuple[str, int]]:
    """The URL's own host and every ``nodes=`` entry, as (host, port)."""
    parts = urlsplit(url)
    seeds = [(parts.hostname or "127.0.0.1", parts.port or 6379)]
    for key, value in _query(url):
        if key == "nodes":
            seeds += [_host_port(n.strip(), 6379) for n in value.split(",") if n.strip()]
    return seeds


def redis_ports(url: str) -> set[int]:
    """Every port the URL names (seed nodes included): endpoints may not point at them."""
    try:
        if is_cluster_url(url):
            return {port for _, port in cluster_seeds(url)}
        return {urlsplit(url).port or 6379}
    except ValueError:
        return set()


def redis_client(
    url: str, *, socket_connect_timeout: float = 0.5, socket_timeout: float = 1.0, **kwargs: Any
) -> RedisClient:
    """A client for ``url`` (see the module docstring); ``kwargs`` go to the connections."""
    if not is_cluster_url(url):
        return aioredis.from_url(
            url, socket_connect_timeout=socket_connect_timeout, socket_timeout=socket_timeout, **kwargs
        )
    parts = urlsplit(url)
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"redis_url: a Redis Cluster has only database 0, not {parts.path!r}")
    rest = [(k, v) for k, v in _query(url) if k not in ("cluster", "nodes")]
    seeds = cluster_seeds(url)
    first = urlunsplit((parts.scheme, parts.netloc, "", urlencode(rest), ""))
    client = _Cluster.from_url(
        first,
        startup_nodes=[ClusterNode(host, port) for host, port in seeds],
        socket_connect_timeout=socket_connect_timeout,
        socket_timeout=socket_timeout,
        **kwargs,
    )
    client.start_initializing()
    return client
