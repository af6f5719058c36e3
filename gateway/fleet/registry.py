"""The set of endpoints and a model → healthy-endpoints index, rebuilt only when health changes.

The per-request path asks ``candidates(model)`` and gets a ready list, so request
cost does not grow with the number of models or with health-check churn.
"""

from __future__ import annotations

import base64
import functools
import ssl
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from gateway.config import ConfigError, EndpointConfig
from gateway.config.fleet import check_api_key
from gateway.fleet.dp import set_ranks, sync_targets
from gateway.fleet.endpoint import Endpoint, EngineKind, Role, public_url

__all__ = ["EndpointRegistry", "endpoint_from_config", "endpoint_ssl_context", "upstream_auth_header"]


def upstream_auth_header(cfg: EndpointConfig) -> str | None:
    """What this endpoint is sent as ``Authorization``: its API key as a bearer token (file wins:
    a mounted Secret), else the URL's user info as Basic auth (``http://user:pw@host``)."""
    token = cfg.api_key
    if cfg.api_key_file:
        try:
            token = check_api_key(Path(cfg.api_key_file).read_text().strip())
        except OSError as exc:
            raise ConfigError(
                f"endpoints: cannot read api_key_file for {public_url(cfg.url)}: {exc.strerror}"
            ) from None
        except ValueError as exc:  # a line end inside it, or no text at all
            raise ConfigError(f"endpoints: api_key_file for {public_url(cfg.url)}: {exc}") from None
    if token:
        return f"Bearer {token}"
    parts = urlsplit(cfg.url)
    if parts.username is None and parts.password is None:
        return None
    pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
    return "Basic " + base64.b64encode(pair.encode()).decode("ascii")


@functools.lru_cache(maxsize=64)
def _ssl_context(ca_file: str | None, verify: bool, mtime: float) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def endpoint_ssl_context(cfg: EndpointConfig) -> ssl.SSLContext | None:
    """The TLS settings of an https endpoint (None for http): its own CA bundle or the system's.

    Contexts are shared by (file, verify, file mtime): loading a CA bundle costs milliseconds
    and every replica of a fleet names the same one; a rotated file gets a new context.
    """
    if not cfg.url.startswith("https://"):
        return None
    mtime = 0.0
    if cfg.tls_ca_file:
        try:
            mtime = Path(cfg.tls_ca_file).stat().st_mtime
        except OSError as exc:
            raise ConfigError(
                f"endpoints: cannot read tls_ca_file for {public_url(cfg.url)}: {exc.strerror}"
            ) from None
    try:
        return _ssl_context(cfg.tls_ca_file, cfg.tls_verify, mtime)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"endpoints: tls_ca_file for {public_url(cfg.url)} is not a PEM CA bundle: {exc}"
        ) from None


def endpoint_from_config(cfg: EndpointConfig) -> Endpoint:
    return Endpoint(
        url=cfg.url,
        role=Role(cfg.role),
        engine=EngineKind(cfg.engine),
        configured_models=frozenset(cfg.models),
        labels=dict(cfg.labels),
        bootstrap_port=cfg.bootstrap_port,
        auth_header=upstream_auth_header(cfg),
        ssl_context=endpoint_ssl_context(cfg),
        max_num_seqs=cfg.max_num_seqs,
        kv_events=cfg.kv_events,
        data_parallel_size=cfg.data_parallel_size,
    )


_DISCOVERY_GRACE_S = 10.0  # a new endpoint's models are unknown until its first probe answers


class EndpointRegistry:
    def __init__(self, endpoints: Iterable[Endpoint] = ()) -> None:
        self._endpoints: dict[str, Endpoint] = {}
        self._by_model: dict[str, list[Endpoint]] = {}
        self._known_models: frozenset[str] = frozenset()
        self.version = 0  # bumped by every rebuild: who caches per-endpoint state sees a change
        # Rank targets that stopped existing (down, fewer configured ranks, or fewer on the
        # engine's page): their state and series go (wired by the app).
        self.on_dropped_targets: Callable[[list[Endpoint]], None] = lambda targets: None
        for endpoint in endpoints:
            self.add(endpoint, rebuild=False)
        self.rebuild()

    def __iter__(self):
        return iter(list(self._endpoints.values()))

    def __len__(self) -> int:
        return len(self._endpoints)

    def __contains__(self, endpoint: object) -> bool:
        """This very endpoint object is a member (not a replaced or removed one with the same URL),
        or a current rank target of one."""
        if not isinstance(endpoint, Endpoint):
            return False
        member = self._endpoints.get(endpoint.url)
        if member is endpoint:
            return True
        return member is not None and endpoint.replica is member and endpoint in member.rank_targets

    def targets(self) -> list[Endpoint]:
        """Every routing target: each replica, or each of its data-parallel ranks instead."""
        return [t for e in self._endpoints.values() for t in (e.rank_targets or (e,))]

    def get(self, url: str) -> Endpoint | None:
        return self._endpoints.get(url)

    def add(self, endpoint: Endpoint, *, rebuild: bool = True) -> None:
        if endpoint.data_parallel_size is not None:  # configured: its ranks route from the start
            if dropped := set_ranks(endpoint, range(endpoint.data_parallel_size)):
                self.on_dropped_targets(dropped)
        self._endpoints[endpoint.url] = endpoint
        if rebuild:
            self.rebuild()

    def remove(self, url: str, *, rebuild: bool = True) -> Endpoint | None:
        endpoint = self._endpoints.pop(url, None)
        if rebuild:
            self.rebuild()
        return endpoint

    def rebuild(self) -> None:
        """Recompute the model index; call after any health or model-list change."""
        self.version += 1
        by_model: dict[str, list[Endpoint]] = {}
        known: set[str] = set()
        dropped: list[Endpoint] = []
        for endpoint in self._endpoints.values():
            known.update(endpoint.models)
            dropped += sync_targets(endpoint)
            if endpoint.healthy and not endpoint.ejected and not endpoint.draining:
                for model in endpoint.models:
                    by_model.setdefault(model, []).extend(endpoint.rank_targets or (endpoint,))
        self._by_model = by_model
        self._known_models = frozenset(known)
        if dropped:
            self.on_dropped_targets(dropped)

    def candidates(self, model: str) -> list[Endpoint]:
        """Routable endpoints serving ``model``: healthy, not ejected, not draining (shared list)."""
        return self._by_model.get(model, [])

    def is_known_model(self, model: str) -> bool:
        """Served by some endpoint — or maybe by one that joined moments ago and is still being probed.

        Only called on the error path, so the scan costs nothing in the common case. It
        turns the first moments after a reload or a discovery change into a retryable
        503 instead of a misleading 404.
        """
        if model in self._known_models:
            return True
        now = time.monotonic()
        return any(not e.models and now - e.created_at < _DISCOVERY_GRACE_S for e in self._endpoints.values())

    def healthy_models(self) -> list[str]:
        return sorted(self._by_model)

    def any_healthy(self) -> bool:
        return any(e.healthy for e in self._endpoints.values())
