"""Launch the peer routers (``sglang-router`` and ``vllm-router`` from PyPI) for benchmarks.

The peers live in their own virtual environment (``.venv-peers`` at the repository root,
created with ``python3 -m venv .venv-peers && .venv-peers/bin/pip install sglang-router
vllm-router``) so that their dependency pins never touch the gateway's environment. When
that venv is absent, the interpreter named by ``LLMGW_PEERS_PYTHON`` is used.

Both routers are Rust binaries wrapped by a Python launcher (one process, no children).
At start-up they try to fetch a tokenizer from a model hub; :func:`offline_env` points
every hub and proxy variable at a dead loopback port so nothing leaves the machine, while
``NO_PROXY`` keeps the traffic to ``127.0.0.1`` workers direct (without it, both routers
send worker health checks to the proxy and never see a healthy worker).

Readiness: both answer ``GET /health`` as soon as the HTTP server is up, but sglang-router
registers workers in the background, so :func:`start_peer` polls ``GET /readiness`` until
it reports ``healthy_workers`` equal to the number of workers given.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from loadtest.harness.ports import free_port
from loadtest.harness.processes import ManagedProcess, ReadyCheck, spawn, wait_ready

__all__ = [
    "PEERS_PYTHON_ENV",
    "PEER_ROUTERS",
    "PeerProcess",
    "PeerSpec",
    "PeerStartError",
    "offline_env",
    "peer_available",
    "peers_python",
    "start_peer",
    "start_router",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
PEERS_VENV = REPO_ROOT / ".venv-peers"
# Not LLM_GATEWAY_*: that prefix is the gateway's own config namespace, where an unknown
# key is a start-up error.
PEERS_PYTHON_ENV = "LLMGW_PEERS_PYTHON"

#: A loopback port nothing listens on: hub and proxy traffic sent there fails at once.
_DEAD_ENDPOINT = "http://127.0.0.1:9"

OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_ENDPOINT": _DEAD_ENDPOINT,
    "HTTP_PROXY": _DEAD_ENDPOINT,
    "HTTPS_PROXY": _DEAD_ENDPOINT,
    "ALL_PROXY": _DEAD_ENDPOINT,
    "http_proxy": _DEAD_ENDPOINT,
    "https_proxy": _DEAD_ENDPOINT,
    "all_proxy": _DEAD_ENDPOINT,
    # Required: without it the routers proxy their worker traffic too and never get ready.
    "NO_PROXY": "127.0.0.1,localhost,::1",
    "no_proxy": "127.0.0.1,localhost,::1",
}


@dataclass(frozen=True)
class PeerSpec:
    """How to launch one peer router.

    ``args`` is a template: ``{host}``, ``{port}``, ``{policy}`` and ``{metrics_port}`` are
    substituted, and ``--worker-urls URL...`` plus caller extras are appended after it.
    """

    name: str
    module: str
    distribution: str
    args: tuple[str, ...]
    policies: tuple[str, ...]
    ready_path: str = "/readiness"

    def command(
        self,
        python: str,
        *,
        host: str,
        port: int,
        metrics_port: int,
        worker_urls: Sequence[str],
        policy: str,
        extra_args: Sequence[str] = (),
    ) -> list[str]:
        """Return the full argv that launches this router."""
        fields = {"host": host, "port": port, "policy": policy, "metrics_port": metrics_port}
        argv = [python, "-m", self.module, *(a.format(**fields) for a in self.args)]
        argv += ["--worker-urls", *worker_urls, *extra_args]
        return argv


_COMMON_ARGS: tuple[str, ...] = (
    "--host", "{host}",
    "--port", "{port}",
    "--policy", "{policy}",
    # Both default to a fixed Prometheus port (29000; sglang binds it on 0.0.0.0):
    # keep it on loopback and on a free port so that several routers can run at once.
    "--prometheus-host", "127.0.0.1",
    "--prometheus-port", "{metrics_port}",
)  # fmt: skip

PEER_ROUTERS: dict[str, PeerSpec] = {
    "sglang-router": PeerSpec(
        name="sglang-router",
        module="sglang_router.launch_router",
        distribution="sglang-router",
        args=(
            *_COMMON_ARGS,
            # At "info" sglang-router logs two lines per request: that costs throughput.
            "--log-level",
            "warn",
            # Default is 180 s: SIGTERM would otherwise wait that long for in-flight requests.
            "--shutdown-grace-period-secs",
            "2",
        ),
        policies=("random", "round_robin", "cache_aware", "power_of_two", "manual"),
    ),
    "vllm-router": PeerSpec(
        name="vllm-router",
        module="vllm_router.launch_router",
        distribution="vllm-router",
        args=(
            *_COMMON_ARGS,
            "--log-level",
            "warning",
            # It blocks until every worker is healthy and re-checks only every 30 s by default.
            "--worker-startup-check-interval",
            "1",
        ),
        policies=(
            "random",
            "round_robin",
            "cache_aware",
            "kv_aware",
            "power_of_two",
            "consistent_hash",
            "sticky_least_loaded",
        ),
    ),
}


class PeerStartError(RuntimeError):
    """A peer router exited or did not become ready in time."""


def peers_python() -> str | None:
    """Return the interpreter that has the peer routers installed, or ``None``.

    ``.venv-peers/bin/python`` at the repository root wins; otherwise the path in
    ``LLMGW_PEERS_PYTHON`` (an absolute path or a name found on ``PATH``).
    """
    venv_python = PEERS_VENV / "bin" / "python"
    if venv_python.exists():
        return str(venv_python)
    configured = os.environ.get(PEERS_PYTHON_ENV)
    if configured:
        return shutil.which(configured) or (configured if Path(configured).exists() else None)
    return None


def offline_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Return ``base`` (default ``os.environ``) with the offline/loopback-only settings on top."""
    env = dict(os.environ if base is None else base)
    env.update(OFFLINE_ENV)
    return env


_AVAILABLE: dict[tuple[str, str], bool] = {}


def peer_available(name: str) -> bool:
    """Whether peer ``name`` can be launched: a peers interpreter exists and imports its module."""
    spec = PEER_ROUTERS.get(name)
    python = peers_python()
    if spec is None or python is None:
        return False
    key = (name, python)
    if key not in _AVAILABLE:
        import subprocess

        package = spec.module.split(".", 1)[0]
        try:
            proc = subprocess.run(
                [
                    python,
                    "-c",
                    f"import importlib.util, sys; sys.exit(importlib.util.find_spec({package!r}) is None)",
                ],
                env=offline_env(),
                capture_output=True,
                timeout=30,
                check=False,
            )
            _AVAILABLE[key] = proc.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            _AVAILABLE[key] = False
    return _AVAILABLE[key]


@dataclass
class PeerProcess(ManagedProcess):
    """A running peer router started by :func:`start_peer`."""

    metrics_port: int = 0
    argv: list[str] = field(default_factory=list)
    startup_s: float = 0.0

    async def __aenter__(self) -> PeerProcess:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _healthy_workers(n_workers: int) -> ReadyCheck:
    async def check(resp: aiohttp.ClientResponse) -> bool:
        body = await resp.json(content_type=None)
        healthy = body.get("healthy_workers") if isinstance(body, dict) else None
        return healthy is None or int(healthy) >= n_workers

    return check


async def start_peer(
    name: str,
    port: int,
    worker_urls: list[str],
    policy: str,
    extra_args: Sequence[str] = (),
    *,
    host: str = "127.0.0.1",
    ready_timeout_s: float = 60.0,
    log_dir: str | os.PathLike[str] | None = None,
) -> PeerProcess:
    """Start peer router ``name`` on ``host:port`` in front of ``worker_urls``.

    The router's output goes to a temporary log file (``PeerProcess.log_path``). Returns
    once ``GET /readiness`` reports every worker healthy; raises :class:`PeerStartError`
    (after stopping the process) if it exits first or is not ready within
    ``ready_timeout_s``.
    """
    spec = PEER_ROUTERS.get(name)
    if spec is None:
        raise ValueError(f"unknown peer router {name!r}; known: {sorted(PEER_ROUTERS)}")
    if policy not in spec.policies:
        raise ValueError(f"{name} has no policy {policy!r}; choose from {spec.policies}")
    if not worker_urls:
        raise ValueError("worker_urls must not be empty")
    python = peers_python()
    if python is None:
        raise PeerStartError(f"no peers interpreter: create {PEERS_VENV} or set {PEERS_PYTHON_ENV}")

    metrics_port = free_port(host)
    argv = spec.command(python, host=host, port=port, metrics_port=metrics_port, worker_urls=worker_urls,
                        policy=policy, extra_args=extra_args)  # fmt: skip
    fd, log_name = tempfile.mkstemp(prefix=f"{name}-{port}-", suffix=".log", dir=log_dir)
    os.close(fd)
    started = time.monotonic()
    proc = await spawn(name, f"http://{host}:{port}", argv, Path(log_name).parent, env=offline_env(),
                       new_session=True, log_path=Path(log_name))  # fmt: skip
    peer = PeerProcess(proc.name, proc.url, proc.process, proc.log_path, metrics_port=metrics_port, argv=argv)
    try:
        await wait_ready(peer, spec.ready_path, ready_timeout_s, check=_healthy_workers(len(worker_urls)),
                         probe_timeout_s=2.0, error=PeerStartError)  # fmt: skip
    except BaseException:
        await peer.stop(grace_s=2.0)
        raise
    peer.startup_s = time.monotonic() - started
    return peer


async def start_router(
    spec: str, worker_urls: list[str], *, log_dir: str | os.PathLike[str] | None = None
) -> PeerProcess:
    """``NAME:POLICY`` (``sglang-router:cache_aware``) in front of ``worker_urls`` on a free
    loopback port: how the benchmarks name a peer router as one of their arms or policies."""
    name, _, policy = spec.partition(":")
    return await start_peer(name, free_port("127.0.0.1"), worker_urls, policy, log_dir=log_dir)
