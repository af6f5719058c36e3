"""Capture what real vLLM says on the wire, next to what our simulator says, for the same requests.

Why: the simulator is only as good as its fidelity to the engine. Each probe is sent
to one real replica and one simulator configured alike (model name, block size, KV
blocks); both raw answers (status, headers, body) land side by side in OUT_DIR:

    python -m loadtest.realvllm.capture tests/e2e_vllm/captures
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.realvllm.fleet import MODEL_NAME, ReplicaOptions, running_fleet

__all__ = ["PROBES", "capture"]

_LONG = " ".join(f"cache{i % 97}" for i in range(150))
_CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def _long_chat(question: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": _LONG}, {"role": "user", "content": question}]
    return {"messages": messages, "max_tokens": 1}


# name → (method, path, body or raw bytes); bodies use the model name both serve.
PROBES: dict[str, tuple[str, str, Any]] = {
    "health": ("GET", "/health", None),
    "models": ("GET", "/v1/models", None),
    "chat": ("POST", "/v1/chat/completions", {"messages": _CHAT, "max_tokens": 3}),
    "chat-stream-usage": (
        "POST",
        "/v1/chat/completions",
        {"messages": _CHAT, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
    ),
    "chat-stream": ("POST", "/v1/chat/completions", {"messages": _CHAT, "max_tokens": 2, "stream": True}),
    "completion": ("POST", "/v1/completions", {"prompt": "hello", "max_tokens": 3}),
    "completion-stream-usage": (
        "POST",
        "/v1/completions",
        {"prompt": "hello", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
    ),
    "cached-1st": ("POST", "/v1/completions", {"prompt": _LONG, "max_tokens": 1}),
    "cached-2nd": ("POST", "/v1/completions", {"prompt": _LONG, "max_tokens": 1}),
    "chat-cached-1st": ("POST", "/v1/chat/completions", _long_chat("a")),
    "chat-cached-2nd": ("POST", "/v1/chat/completions", _long_chat("b")),
    "err-unknown-model": ("POST", "/v1/chat/completions", {"model": "nope", "messages": _CHAT}),
    "err-bad-json": ("POST", "/v1/chat/completions", b'{"model": "x", "messages": ['),
    "err-missing-messages": ("POST", "/v1/chat/completions", {}),
    "err-max-tokens-negative": ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    "err-max-tokens-over-model-len": ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 5000}),
    "max-tokens-clamped": (
        "POST",
        "/v1/completions",
        {"prompt": "hi " * 1000, "max_tokens": 2000, "ignore_eos": True},
    ),
    "err-prompt-too-long": ("POST", "/v1/completions", {"prompt": "hi " * 2100, "max_tokens": 1}),
    "err-empty-prompt": ("POST", "/v1/completions", {"prompt": ""}),
    "priority-without-priority-scheduling": (
        "POST",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 1, "priority": 3},
    ),
    "batched-prompts": ("POST", "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1}),
    "err-token-out-of-vocab": ("POST", "/v1/completions", {"prompt": [99999], "max_tokens": 1}),
}


def _render(status: int, reason: str, headers: Any, body: bytes) -> str:
    head = "\n".join(f"{k}: {v}" for k, v in headers.items() if k.lower() != "date")
    return f"HTTP {status} {reason}\n{head}\n\n{body.decode(errors='replace')}\n"


async def _probe(http: aiohttp.ClientSession, base: str, method: str, path: str, body: Any) -> str:
    kwargs: dict[str, Any] = {}
    if isinstance(body, bytes):
        kwargs = {"data": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kwargs = {"json": {"model": MODEL_NAME, **body}}
    async with http.request(method, base + path, **kwargs) as resp:
        return _render(resp.status, resp.reason or "", resp.headers, await resp.read())


async def _disconnect(http: aiohttp.ClientSession, base: str) -> str:
    """Abort a stream after a few chunks; return the abort counters vLLM exposes afterwards."""
    body = {"model": MODEL_NAME, "prompt": "x " * 50, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    resp = await http.post(base + "/v1/completions", json=body)
    seen = 0
    async for line in resp.content:
        seen += line.startswith(b"data: ")
        if seen == 5:
            break
    resp.close()
    await asyncio.sleep(1.0)
    async with http.get(base + "/metrics") as m:
        text = await m.text()
    keep = ("vllm:num_requests_running", "vllm:request_success_total", "vllm:generation_tokens_total")
    return "\n".join(line for line in text.splitlines() if line.startswith(keep)) + "\n"


async def capture(out_dir: Path, targets: dict[str, str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for label, base in targets.items():
            async with http.get(base + "/metrics") as resp:
                (out_dir / f"metrics-idle.{label}.txt").write_text(await resp.text())
            lines = []
            for name, (method, path, body) in PROBES.items():
                shown = json.dumps(body) if isinstance(body, dict) else body
                lines.append(f"### {name}: {method} {path} {shown}")
                lines.append(await _probe(http, base, method, path, body))
            (out_dir / f"probes.{label}.txt").write_text("\n".join(lines))
            (out_dir / f"disconnect.{label}.txt").write_text(await _disconnect(http, base))
            async with http.get(base + "/metrics") as resp:
                (out_dir / f"metrics-after.{label}.txt").write_text(await resp.text())


async def _with_simulator(out_dir: Path, vllm_url: str, options: ReplicaOptions) -> None:
    from loadtest.harness.fleet import start_replicas, stop_all

    sim_args = ["--model", MODEL_NAME, "--block-size", str(options.block_size)]
    sim_args += ["--kv-blocks", str(options.num_blocks), "--max-model-len", str(options.max_model_len)]
    sims = await start_replicas(1, sim_args)
    try:
        await capture(out_dir, {"vllm": vllm_url, "sim": sims[0].url})
    finally:
        await stop_all(sims)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.realvllm.capture", description=__doc__)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    options = ReplicaOptions(num_blocks=128)
    with running_fleet(1, options) as replicas:
        asyncio.run(_with_simulator(args.out_dir, replicas[0].url, options))
    print(f"captures in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
