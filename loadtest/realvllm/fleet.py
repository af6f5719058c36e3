"""Real vLLM replicas (CPU build) as OS processes, for end-to-end tests and benchmarks.

Runs from the main virtualenv and never imports vLLM or torch: vLLM lives in its own
``.venv-vllm`` (``install.sh``), the tiny model is built by a subprocess of that
venv's python (``model.py``), and each replica is ``launcher.py serve`` in its own
process group so that stopping it by PID also ends its engine-core children.
Everything binds 127.0.0.1 and the environment keeps every lookup offline.

Process management is synchronous on purpose: a test session fixture starts the
fleet once, outside any event loop, and each test then talks to it over HTTP.

    python -m loadtest.realvllm.fleet --replicas 2            # start, print URLs, wait for Ctrl-C
    python -m loadtest.realvllm.bench                          # prefix-aware vs round-robin table
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.harness.ports import free_ports
from loadtest.harness.procfs import process_tree, rss_kib

__all__ = [
    "MODEL_NAME",
    "Replica",
    "ReplicaExited",
    "ReplicaOptions",
    "ensure_installed",
    "ensure_model",
    "http_get",
    "http_post",
    "offline_env",
    "restart_replica",
    "running_fleet",
    "start_replica",
    "start_replicas",
    "stop_replicas",
    "venv_dir",
    "wait_ready",
    "wait_ready_retrying",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MODEL_NAME = "tiny-llama"
# vLLM logs this (with the traceback after it) when a worker of a starting engine fails.
_ROOT_CAUSE_MARK = "EngineCore failed to start"
_START_ATTEMPTS = 2  # a replica that exits while starting gets one more try, on fresh ports
_DEAD_PROXY = "http://127.0.0.1:9"  # nothing listens there: any escaping request fails at once
# A direct opener: urllib would otherwise honour the dead proxies set for the replicas.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def venv_dir() -> Path:
    return REPO_ROOT / os.environ.get("LLMGW_VLLM_VENV", ".venv-vllm")


def _python() -> Path:
    return venv_dir() / "bin" / "python"


def ensure_installed() -> float:
    """Run ``install.sh`` unless the venv is complete; returns the seconds it took (0 if present)."""
    if _python().exists() and any(venv_dir().glob(".installed-*")):
        return 0.0
    started = time.monotonic()
    subprocess.run(["bash", str(HERE / "install.sh")], cwd=REPO_ROOT, check=True)
    return time.monotonic() - started


def ensure_model() -> Path:
    """The tiny model's directory, built (seeded, a few seconds) on first use."""
    out = venv_dir() / "models" / MODEL_NAME
    if not (out / "BUILD_INFO").exists():
        argv = [str(_python()), str(HERE / "model.py"), str(out)]
        subprocess.run(argv, cwd=REPO_ROOT, check=True, env=offline_env(None))
    return out


def offline_env(cache_dir: Path | None) -> dict[str, str]:
    """The replicas' environment: offline, 127.0.0.1 only, one OMP thread, caches in ``cache_dir``."""
    env = dict(os.environ)
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "HF_ENDPOINT"):
        env[name] = _DEAD_PROXY
    env.update(
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache, so runs start from a cold cache
        VLLM_ENABLE_RESPONSES_API_STORE="1",  # GET /v1/responses/{id}, previous_response_id chains
        PYTHONUNBUFFERED="1",
    )
    env.pop("VIRTUAL_ENV", None)
    if cache_dir is not None:
        env.update(
            XDG_CACHE_HOME=str(cache_dir),
            VLLM_CACHE_ROOT=str(cache_dir / "vllm"),
            TORCHINDUCTOR_CACHE_DIR=str(cache_dir / "inductor"),
        )
    return env


@dataclass(frozen=True)
class ReplicaOptions:
    """What shapes one replica; ``num_blocks`` small puts the prefix cache under pressure."""

    num_blocks: int | None = None  # --num-gpu-blocks-override (blocks of block_size tokens)
    block_size: int = 32  # 16 is rejected by the CPU backend
    max_model_len: int = 2048
    dtype: str = "bfloat16"
    enforce_eager: bool = False
    # KV events: ZMQ PUB (tcp://*:port, see kv_events_config) + replay ROUTER (127.0.0.1), own ports
    kv_events: bool = False
    kv_topic: str = "kv"
    extra_args: tuple[str, ...] = ()
    # > 0: the engine runs at this niceness, so on a small shared host it takes the cores the
    # gateway and the load generator leave (as on a real deployment: the router has its own)
    nice: int = 0


def kv_events_config(pub_port: int, replay_port: int, topic: str = "kv") -> str:
    """vLLM's ``--kv-events-config`` for a ZMQ publisher on ``pub_port`` with replay on ``replay_port``.

    The PUB address must be a wildcard: vLLM 0.32 *binds* ``tcp://*:PORT`` but *connects*
    to an address with a host (``tcp://127.0.0.1:PORT``), where no subscriber listens. The
    replay ROUTER always binds, so it stays on loopback."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{pub_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
            "topic": topic,
        }
    )


def _argv(
    model_dir: Path, port: int, options: ReplicaOptions, kv_ports: tuple[int, int] | None = None
) -> list[str]:
    argv = [
        str(_python()), str(HERE / "launcher.py"), "serve", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", MODEL_NAME,
        "--max-model-len", str(options.max_model_len),
        "--block-size", str(options.block_size),
        "--dtype", options.dtype,
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if options.num_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(options.num_blocks)]
    if options.enforce_eager:
        argv.append("--enforce-eager")
    if kv_ports is not None:
        argv += ["--kv-events-config", kv_events_config(*kv_ports, options.kv_topic)]
    return [*argv, *options.extra_args]


@dataclass
class Replica:
    index: int
    port: int
    options: ReplicaOptions
    process: subprocess.Popen[bytes]
    log_path: Path
    started_at: float
    ready_s: float | None = None
    terminated: bool = False
    kv_ports: tuple[int, int] | None = None  # (PUB, replay ROUTER) with options.kv_events

    @property
    def name(self) -> str:
        return f"vllm-{self.index}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, max_chars: int = 4000) -> str:
        """The log's end and, before it, its first error lines: an engine core that dies while
        starting prints its root cause long before the API server's own traceback."""
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace")
            tail = text[-max_chars:]
            lines = text[: len(text) - len(tail)].splitlines()
            first = next((i for i, line in enumerate(lines) if _ROOT_CAUSE_MARK in line), None)
            cause = "\n".join(lines[first : first + 60]) if first is not None else ""
            return f"{cause}\n[...]\n{tail}" if cause else tail
        return ""

    def rss_bytes(self) -> int:
        """Resident memory of the API server and every process under it (engine core, worker)."""
        return sum((rss_kib(pid) or 0) * 1024 for pid in process_tree(self.pid))

    def terminate(self) -> None:
        """SIGTERM once (a second one makes uvicorn skip its graceful shutdown)."""
        if self.alive() and not self.terminated:
            self.terminated = True
            self.process.terminate()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the API server (vLLM then shuts its engine down); SIGKILL its group if it lingers."""
        if self.alive():
            self.terminate()
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                _killpg(self.pid)
                self.process.wait()
        # The group is ours (start_new_session): end any child the API server left behind.
        deadline = time.monotonic() + 5.0
        while _group_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        _killpg(self.pid)


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    try:
        with _OPENER.open(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_post(url: str, body: object | None = None, timeout_s: float = 30.0) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, method="POST", headers={"content-type": "application/json"})
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _healthy(url: str) -> bool:
    try:
        return http_get(url + "/health", timeout_s=1.0)[0] == 200
    except (OSError, urllib.error.URLError):
        return False


def start_replica(
    index: int,
    port: int,
    options: ReplicaOptions,
    *,
    log_dir: Path,
    cache_root: Path | None = None,
    kv_ports: tuple[int, int] | None = None,
) -> Replica:
    """Spawn one replica (not yet waited for). Its compile cache persists under the venv by default.

    With ``options.kv_events`` it publishes KV events on ``kv_ports`` (two free ports if None)."""
    model_dir = ensure_model()
    if options.kv_events and kv_ports is None:
        pub, replay = free_ports(2)
        kv_ports = (pub, replay)
    if not options.kv_events:
        kv_ports = None
    cache = (cache_root or venv_dir() / "cache") / f"replica-{index}"
    cache.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{index}-{port}.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [
                *(["nice", "-n", str(options.nice)] if options.nice else []),
                *_argv(model_dir, port, options, kv_ports),
            ],
            cwd=REPO_ROOT,
            env=offline_env(cache),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Replica(index, port, options, process, log_path, time.monotonic(), kv_ports=kv_ports)


def restart_replica(replica: Replica, timeout_s: float = 240.0, cache_root: Path | None = None) -> Replica:
    """Stop ``replica`` if it still runs, then start it again on its port (its compile cache is warm)."""
    replica.stop()
    fresh = start_replica(
        replica.index,
        replica.port,
        replica.options,
        log_dir=replica.log_path.parent,
        cache_root=cache_root,
        kv_ports=replica.kv_ports,
    )
    try:
        wait_ready([fresh], timeout_s)
    except BaseException:
        fresh.stop()
        raise
    return fresh


class ReplicaExited(RuntimeError):
    """A replica's process ended before it answered ``/health``."""

    def __init__(self, replica: Replica) -> None:
        super().__init__(f"{replica.name} exited with {replica.process.returncode}:\n{replica.log_tail()}")
        self.replica = replica


def wait_ready(replicas: Sequence[Replica], timeout_s: float = 240.0) -> None:
    """Until every replica answers ``/health`` 200; a replica that exits or is late fails with its log."""
    deadline = time.monotonic() + timeout_s
    pending = [r for r in replicas if r.ready_s is None]
    while pending:
        for replica in list(pending):
            if not replica.alive():
                raise ReplicaExited(replica)
            if _healthy(replica.url):
                replica.ready_s = time.monotonic() - replica.started_at
                pending.remove(replica)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{pending[0].name} not healthy after {timeout_s}s:\n{pending[0].log_tail()}")
        time.sleep(0.25)


def start_replicas(
    count: int,
    options: ReplicaOptions = ReplicaOptions(),
    *,
    log_dir: Path | None = None,
    cache_root: Path | None = None,
    timeout_s: float = 240.0,
) -> list[Replica]:
    """``count`` replicas on free ports, started together, all healthy (or all stopped and an error)."""
    ensure_installed()
    ensure_model()
    directory = log_dir or Path(tempfile.mkdtemp(prefix="llmgw-vllm-"))
    directory.mkdir(parents=True, exist_ok=True)
    replicas: list[Replica] = []
    try:
        ports = free_ports(count * 3 if options.kv_events else count)  # held together: all distinct
        for index, port in enumerate(ports[:count]):
            kv = (ports[count + 2 * index], ports[count + 2 * index + 1]) if options.kv_events else None
            replicas.append(
                start_replica(index, port, options, log_dir=directory, cache_root=cache_root, kv_ports=kv)
            )
        wait_ready_retrying(replicas, timeout_s, directory, cache_root)
    except BaseException:
        stop_replicas(replicas)
        raise
    return replicas


def wait_ready_retrying(
    replicas: list[Replica], timeout_s: float, directory: Path, cache_root: Path | None = None
) -> None:
    """``wait_ready``, but a replica that *exits* while starting (not one that is late) is started
    again on fresh ports, once, with its first log's root cause printed: on a shared CI machine an
    engine core has died in start-up while its twin came up, and one lost start must not fail
    the whole suite. A second exit fails with both logs' causes."""
    deadline = time.monotonic() + timeout_s
    for attempt in range(1, _START_ATTEMPTS + 1):
        try:
            wait_ready(replicas, max(1.0, deadline - time.monotonic()))
            return
        except ReplicaExited as exc:
            if attempt == _START_ATTEMPTS:
                raise
            dead = exc.replica
            print(f"\n{dead.name} exited while starting (attempt {attempt}); starting it again:\n{exc}")
            fresh_port, *kv = free_ports(3 if dead.kv_ports else 1)
            index = replicas.index(dead)
            replicas[index] = start_replica(
                dead.index, fresh_port, dead.options, log_dir=directory, cache_root=cache_root,
                kv_ports=(kv[0], kv[1]) if kv else None,
            )  # fmt: skip


def stop_replicas(replicas: Sequence[Replica]) -> None:
    for replica in replicas:
        replica.terminate()  # all at once: their shutdowns overlap
    for replica in replicas:
        replica.stop()


@contextlib.contextmanager
def running_fleet(
    count: int,
    options: ReplicaOptions = ReplicaOptions(),
    *,
    log_dir: Path | None = None,
    timeout_s: float = 240.0,
) -> Iterator[list[Replica]]:
    replicas = start_replicas(count, options, log_dir=log_dir, timeout_s=timeout_s)
    try:
        yield replicas
    finally:
        stop_replicas(replicas)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _serve(args: argparse.Namespace) -> int:
    options = ReplicaOptions(num_blocks=args.num_blocks, kv_events=args.kv_events, enforce_eager=args.eager)
    with running_fleet(args.replicas, options, timeout_s=args.timeout) as replicas:
        for r in replicas:
            rss = r.rss_bytes() / 2**30
            print(f"{r.name} {r.url} pid={r.pid} ready_in={r.ready_s:.1f}s rss={rss:.2f}GiB")
            print(f"  log: {r.log_path}")
            if r.kv_ports:
                print(f"  kv events: tcp://127.0.0.1:{r.kv_ports[0]} replay tcp://127.0.0.1:{r.kv_ports[1]}")
        print("Ctrl-C or SIGTERM stops them.", flush=True)
        with contextlib.suppress(SystemExit):
            while all(r.alive() for r in replicas):
                time.sleep(1.0)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.realvllm.fleet", description=__doc__)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--num-blocks", type=int, default=None, help="--num-gpu-blocks-override per replica")
    parser.add_argument("--kv-events", action="store_true", help="publish KV events (ZMQ) on two ports each")
    parser.add_argument("--eager", action="store_true", help="--enforce-eager: no compilation at start-up")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds for the replicas to be healthy")
    args = parser.parse_args(argv)
    install_signal_exits()
    return _serve(args)


def install_signal_exits() -> None:
    """SIGTERM, and SIGINT even where a non-interactive shell started us with it ignored, must
    unwind through running_fleet so the replicas (in their own sessions) are stopped too."""
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)


if __name__ == "__main__":
    sys.exit(main())
