"""Capture a real vLLM replica's KV-event frames (and what the gateway asks it) into a JSON file.

    .venv/bin/python -m loadtest.realvllm.kv_capture tests/e2e_vllm/captures/kv-events.vllm.json \\
        [--url http://127.0.0.1:PORT]      # a running replica started with --kv-events; else one is started

Records, as the engine answers them: ``GET /kv_event_sources``; ``POST /tokenize`` and
``POST /v1/chat/completions/render`` for one chat request; and the raw ZMQ frames
``[topic, seq, payload]`` of a short scripted run — a chat request (``BlockStored``), the
same prompt again (a hit: no new blocks), enough distinct prompts to evict
(``BlockRemoved``), ``POST /reset_prefix_cache`` (``AllBlocksCleared``), and a replay
request (the ROUTER's answer). Payloads are kept as hex next to their msgpack decoding
(bytes as ``{"__bytes__": hex}``), so ``tests/loadtest/test_kv_events_parity.py`` can check
the simulator's frames against vLLM's without vLLM installed.

Runs from the main venv (pyzmq, msgspec); never imports vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from loadtest.realvllm.fleet import MODEL_NAME, ReplicaOptions, http_get, http_post, running_fleet

__all__ = ["capture", "jsonable"]

CHAT = [
    {"role": "system", "content": "You are a careful assistant for the river bridge survey."},
    {"role": "user", "content": "Describe the stone bridge " + "and its arches " * 12},
]


def jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"__bytes__": value.hex()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value


def _frame(frames: list[bytes]) -> dict[str, Any]:
    out: dict[str, Any] = {"frames": len(frames), "hex": [f.hex() for f in frames]}
    if len(frames) == 3:
        out["topic"] = frames[0].decode(errors="replace")
        out["seq"] = int.from_bytes(frames[1], "big", signed=True)
        out["decoded"] = jsonable(msgspec.msgpack.decode(frames[2])) if frames[2] else None
    return out


def _drain(sub: zmq.Socket, settle_s: float = 1.0) -> list[dict[str, Any]]:
    out = []
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        if sub.poll(100):
            out.append(_frame(sub.recv_multipart()))
            deadline = time.monotonic() + settle_s
    return out


def _chat(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    status, body = http_post(
        url + "/v1/chat/completions", {"model": MODEL_NAME, "messages": messages, "max_tokens": 4}
    )
    assert status == 200, body
    return json.loads(body)


def _replay(replay: str, start: int) -> list[dict[str, Any]]:
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while dealer.poll(3000):
            frames = dealer.recv_multipart()
            out.append(_frame(frames[1:]) | {"dealer_frames": len(frames)})
            if frames[-2] == (-1).to_bytes(8, "big", signed=True):
                break
        return out


def capture(url: str, pub: str, replay: str | None) -> dict[str, Any]:
    status, sources = http_get(url + "/kv_event_sources")
    record: dict[str, Any] = {"kv_event_sources": {"status": status, "body": json.loads(sources)}}
    body = {"model": MODEL_NAME, "messages": CHAT}
    record["tokenize"] = json.loads(http_post(url + "/tokenize", body)[1])
    status, render = http_post(url + "/v1/chat/completions/render", body)
    try:
        rendered: Any = json.loads(render) if render else None
    except ValueError:
        rendered = render.decode(errors="replace")
    record["render"] = {"status": status, "body": rendered}
    with zmq.Context() as ctx, ctx.socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)
        time.sleep(0.5)  # the slow joiner
        http_post(url + "/reset_prefix_cache")
        _drain(sub)
        steps: dict[str, Any] = {}
        answer = _chat(url, CHAT)
        steps["first"] = {"usage": answer["usage"], "events": _drain(sub)}
        answer = _chat(url, CHAT)
        steps["repeat"] = {"usage": answer["usage"], "events": _drain(sub)}
        evicting = []
        for i in range(16):  # 16 × ≥ 10 blocks > 128 blocks: the first prompts' blocks go
            text = f"prompt {i} " + " ".join(f"w{i}x{j}" for j in range(300))
            _chat(url, [{"role": "user", "content": text}])
            evicting += _drain(sub, 0.3)
        steps["evicting"] = {"events": evicting}
        http_post(url + "/reset_prefix_cache")
        steps["reset"] = {"events": _drain(sub)}
        record["steps"] = steps
    if replay:
        seqs = [e["seq"] for step in record["steps"].values() for e in step["events"] if "seq" in e]
        record["replay"] = _replay(replay, seqs[-2] if len(seqs) > 1 else 0)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.realvllm.kv_capture", description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--url", help="a running replica (with --pub/--replay); default: start one")
    parser.add_argument("--pub")
    parser.add_argument("--replay")
    args = parser.parse_args(argv)
    if args.url:
        record = capture(args.url, args.pub, args.replay)
    else:
        with running_fleet(1, ReplicaOptions(num_blocks=128, kv_events=True)) as (replica,):
            assert replica.kv_ports is not None
            pub, rep = (f"tcp://127.0.0.1:{p}" for p in replica.kv_ports)
            record = capture(replica.url, pub, rep)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
