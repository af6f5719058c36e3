"""Command line: `llm-gateway sim ...` / `python -m loadtest.simulator ...`.

One replica runs in-process. `--replicas N` starts one child process per replica
(own interpreter and event loop, so step timing stays faithful on few cores) and
supervises them, ending them all on SIGINT/SIGTERM or when one dies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import subprocess
import sys
import time

from .config import ENGINES, ROLES, SimConfig
from .server import start_runner

log = logging.getLogger("loadtest.simulator")


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the simulator's options to `parser`."""
    d = SimConfig()
    parser.add_argument("--host", default=d.host, help="bind address (keep 127.0.0.1)")
    parser.add_argument("--port", type=int, default=d.port, help="port (0 = any free port)")
    parser.add_argument("--engine", choices=ENGINES, default=d.engine)
    parser.add_argument("--role", choices=ROLES, default=d.role)
    parser.add_argument("--model", default=d.model)
    parser.add_argument("--kv-blocks", type=int, default=d.kv_blocks)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-batched-tokens", type=int, default=d.max_batched_tokens)
    parser.add_argument("--time-scale", type=float, default=d.time_scale, help="X = run X times faster")
    parser.add_argument("--decode-step-ms", type=float, default=d.decode_step_ms)
    parser.add_argument("--prefill-us-per-token", type=float, default=d.prefill_us_per_token)
    parser.add_argument("--decode-us-per-kv-token", type=float, default=d.decode_us_per_kv_token)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default=d.scheduling_policy,
        help="priority: waiting requests ordered by the body's 'priority' (lower first), as vLLM",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="vLLM's --max-model-len: longer prompts get vLLM's 400, max_tokens is clamped to what fits",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=d.shutdown_timeout_s,
        help="vLLM's --shutdown-timeout: on SIGTERM let in-flight requests run this many seconds, "
        "then end them with finish_reason 'abort' (0, the default: at once)",
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="publish vLLM's KV events (ZMQ PUB + replay ROUTER; GET /kv_event_sources tells where)",
    )
    parser.add_argument("--kv-events-port", type=int, default=0, help="PUB port (0: any free port)")
    parser.add_argument("--kv-events-replay-port", type=int, default=0, help="replay ROUTER port (0: any)")
    parser.add_argument("--kv-events-topic", default=d.kv_events_topic)
    parser.add_argument(
        "--data-parallel-size", type=int, default=d.data_parallel_size,
        help="N schedulers + KV caches behind one port, as vLLM's (X-data-parallel-rank, engine label)",
    )  # fmt: skip
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (vLLM's flag)")
    parser.add_argument("--max-loras", type=int, default=d.max_loras, help="adapters per batch (GPU slots)")
    parser.add_argument("--lora-modules", nargs="*", default=[], help="name=path ... (static adapters)")
    parser.add_argument(
        "--lora-load-ms", type=float, default=d.lora_load_ms, help="modelled cost of loading an adapter"
    )
    parser.add_argument("--replicas", type=int, default=1, help="start N replicas, one process each")
    parser.add_argument(
        "--base-port", type=int, default=None, help="first port with --replicas (default --port)"
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        host=args.host,
        port=args.port,
        engine=args.engine,
        role=args.role,
        model=args.model,
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens,
        time_scale=args.time_scale,
        decode_step_ms=args.decode_step_ms,
        prefill_us_per_token=args.prefill_us_per_token,
        decode_us_per_kv_token=args.decode_us_per_kv_token,
        seed=args.seed,
        scheduling_policy=args.scheduling_policy,
        max_model_len=args.max_model_len,
        shutdown_timeout_s=args.shutdown_timeout,
        kv_events=getattr(args, "kv_events", False),
        kv_events_port=getattr(args, "kv_events_port", 0),
        kv_events_replay_port=getattr(args, "kv_events_replay_port", 0),
        kv_events_topic=getattr(args, "kv_events_topic", "kv-events"),
        data_parallel_size=getattr(args, "data_parallel_size", 1),
        enable_lora=getattr(args, "enable_lora", False),
        max_loras=getattr(args, "max_loras", 1),
        lora_modules=tuple(getattr(args, "lora_modules", ())),
        lora_load_ms=getattr(args, "lora_load_ms", 50.0),
    )


_PASSTHROUGH = (
    "host", "engine", "role", "model", "kv_blocks", "block_size", "max_num_seqs", "max_batched_tokens",
    "time_scale", "decode_step_ms", "prefill_us_per_token", "decode_us_per_kv_token", "scheduling_policy",
    "max_model_len", "shutdown_timeout", "data_parallel_size",
)  # fmt: skip


def _child_argv(args: argparse.Namespace, port: int, index: int) -> list[str]:
    argv = [sys.executable, "-m", "loadtest.simulator", "--port", str(port)]
    for key in _PASSTHROUGH:
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if getattr(args, "kv_events", False):  # each child its own ports: given ones offset by 2 per replica
        kv_port, replay_port = args.kv_events_port, args.kv_events_replay_port
        argv += ["--kv-events", "--kv-events-topic", args.kv_events_topic]
        step = 2 * getattr(args, "data_parallel_size", 1) * index  # each rank its own pair
        argv += ["--kv-events-port", str(kv_port + step if kv_port else 0)]
        argv += ["--kv-events-replay-port", str(replay_port + step if replay_port else 0)]
    if getattr(args, "enable_lora", False):
        argv += ["--enable-lora", "--max-loras", str(args.max_loras)]
        argv += ["--lora-load-ms", str(args.lora_load_ms)]
        argv += ["--lora-modules", *args.lora_modules] if args.lora_modules else []
    return [*argv, "--seed", str(args.seed + index)]


async def _serve(config: SimConfig) -> None:
    runner, sim = await start_runner(config)
    log.info("sim replica %s engine=%s role=%s model=%s", sim.url, config.engine, config.role, config.model)
    print(f"sim replica ready {sim.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _supervise(args: argparse.Namespace) -> int:
    base = args.base_port if args.base_port is not None else args.port
    procs = [subprocess.Popen(_child_argv(args, base + i, i)) for i in range(args.replicas)]
    stopping = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    rc = 0
    try:
        while not stopping:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                log.error("replica pid %d exited with %s; stopping all", dead[0].pid, dead[0].returncode)
                rc = 1
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5 + args.shutdown_timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for s, h in old.items():
            signal.signal(s, h)
    return rc


def run_sim(args: argparse.Namespace) -> int:
    """Run one replica in-process, or supervise `--replicas N` child processes. Returns an exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if getattr(args, "replicas", 1) > 1:
        return _supervise(args)
    config = config_from_args(args)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is optional
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(_serve(config))
    return 0
