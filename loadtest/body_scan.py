"""What the hostile-body guards cost per request body, against decoding the same body.

``python -m loadtest.body_scan``: for a short chat body, an agent body (40 turns, 20 tools,
~56 KB) and a 12 MB body of tool schemas, the time of the depth scan
(``guards.nesting_exceeds``) and of the whole ``load_object`` (scan + decode), each as a
ratio to ``msgspec.json.decode`` of the same bytes measured in the same run: the decode is
the floor any parse pays. Both run on the event loop, so a body's time here is how long it
holds every other request up.
"""

from __future__ import annotations

import argparse
import json
import timeit

import msgspec

from gateway.errors import BadRequest
from gateway.request.guards import load_object, nesting_exceeds


def _tool(name: str, properties: int) -> dict[str, object]:
    schema = {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(properties)}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": "d" * 200,
            "parameters": {"type": "object", "properties": schema},
        },
    }


def bodies() -> dict[str, bytes]:
    turn = 'some text with code `a[i] = {b}` and "quotes" ' * 20
    agent = {
        "model": "m",
        "messages": [{"role": ("user", "assistant")[i % 2], "content": turn} for i in range(40)],
        "tools": [_tool(f"f{i}", 6) for i in range(20)],
    }
    tools = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [_tool(f"f{i}", 40) for i in range(2600)],
    }
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello there " * 30}], "max_tokens": 16}
    floats = {"model": "m", "input": [1e308] * 16_000}  # msgspec's slow path: ~15 µs a float
    tokens = {"model": "m", "prompt": list(range(30_000))}  # a token-id prompt, walked at C speed
    # Hostile short bodies (under 2 x max_json_containers bytes, which are decoded first unless
    # dense in values): many tiny containers, and a tower near the depth limit.
    empties = b'{"model": "m", "input": [' + b"[]," * 66_000 + b"[]]}"
    tower = b'{"model": "m", "input": [' + (b"[" * 30 + b"]" * 30 + b",") * 3_000 + b"0]}"
    encoded = {
        name: json.dumps(body).encode()
        for name, body in (
            ("chat", chat),
            ("agent", agent),
            ("tools_12mb", tools),
            ("floats_1e308", floats),
            ("token_ids", tokens),
        )
    }
    return {**encoded, "empty_arrays": empties, "towers_depth_31": tower}


def _load(raw: bytes) -> object:
    """``load_object`` with the default limits (32 levels, 100,000 containers); a refusal is
    timed like an acceptance."""
    try:
        return load_object(raw, 32, 100_000)
    except BadRequest:
        return None


def _best_us(fn, repeat: int, number: int) -> float:
    return min(timeit.repeat(fn, repeat=repeat, number=number)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print("| body | bytes | decode µs | scan µs | scan ÷ decode | load_object µs | load ÷ decode |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, raw in bodies().items():
        number = max(1, 2_000_000 // len(raw))
        decode = _best_us(lambda raw=raw: msgspec.json.decode(raw), args.repeat, number)  # msgspec's own
        scan = _best_us(lambda raw=raw: nesting_exceeds(raw, 32), args.repeat, number)
        load = _best_us(lambda raw=raw: _load(raw), args.repeat, number)
        cells = [name, f"{len(raw):,}", f"{decode:,.1f}", f"{scan:,.1f}", f"{scan / decode:.2f}"]
        print("| " + " | ".join([*cells, f"{load:,.1f}", f"{load / decode:.2f}"]) + " |")


if __name__ == "__main__":
    main()
