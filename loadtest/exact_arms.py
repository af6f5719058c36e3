"""The arms of :mod:`loadtest.exact_bench`: what stands in front of the replicas in each.

Gateway arms are ``llm-gateway serve`` with a preset and a config file (JSON is YAML). Some of
them put another router's cost model on the gateway's exact fleet state, so that the cost
model is the only difference from ``exact`` (the default preset's ``prefix-cost``):

- ``dynamo-cost`` — NVIDIA Dynamo's KV router: the lowest ``overlap_score_weight × prefill
  blocks + active blocks`` (``kv-block-cost``, weight 1.0, temperature 0: its defaults;
  https://docs.nvidia.com/dynamo/latest/router/README.html "Cost Function",
  ``ai-dynamo/dynamo`` ``lib/llm/src/kv_router/scheduler.rs`` ``DefaultWorkerSelector``), active
  blocks from the gateway's in-flight prompt tokens; ``dynamo-cost-engine`` the same with them
  from the engine's scraped KV usage (``active_blocks: engine``); ``dynamo-cost-w4`` and ``-w16``
  with ``overlap_score_weight`` 4 and 16;
- ``llm-d-weights`` — llm-d's precise prefix-cache routing profile: ``precise-prefix-cache-scorer``
  ×3, ``kv-cache-utilization-scorer`` ×2, ``queue-scorer`` ×2, ``max-score-picker``
  (``llm-d/llm-d`` ``guides/precise-prefix-cache-aware/gaie-kv-events/values.yaml``; the newer
  ``scheduler/precise-prefix-cache-aware.values.yaml`` has 2/1/1), as ``prefix-affinity``
  (``normalize: min-max``) ×3, ``kv-utilization`` ×2, ``queue-depth`` ×2;
- all of them tokenize as ``exact-local`` when the bench has ``--tokenizer``, else as ``exact``;
- ``approximate-redis`` is ``approximate`` with the index in Redis (a fresh key prefix per
  arm): with ``--gateways N`` it is how N gateways share one picture without KV events;
  ``approximate-redis-25ms`` gives each Redis call 25 ms instead of the 5 ms default;
- ``NAME-pending`` and ``NAME-no-pending`` (``exact-pending``, ``exact-local-no-pending``…) are
  arm ``NAME`` with ``prefix.kv_events.pending_blocks`` on or off (blocks sent and not reported
  by the engine yet count for routing: :mod:`gateway.prefix.pending_blocks`).

``sglang-router`` is sglang-router 0.3.2 ``cache_aware`` (its own process,
:func:`loadtest.peers.start_router`): no prediction header, so its error is n/a. ``ideal`` measures
the workload without eviction: every request straight to one replica whose cache never evicts
(a simulator with 1M blocks; on real vLLM, its own replica with the full 1 GiB KV space). It
misses only what no cache holds yet (and prefixes still being prefilled when a request
arrives); the strict bound for every arm is :mod:`loadtest.hit_ceiling`, computed offline.
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.harness.fleet import start_gateway
from loadtest.peers import start_router

__all__ = ["ARMS", "IDEAL", "IDEAL_SIM_BLOCKS", "PEERS", "Front", "arm_names", "start_front"]

_ENGINE_TOKENS = {"exact": "auto", "kv_events": {"tokenizer": {"source": "engine"}}}


def _profile(picker: dict[str, Any], *scorers: tuple[dict[str, Any], float]) -> dict[str, Any]:
    """A config's ``plugins`` + one ``default`` profile: the base filters, weighted scorers, picker."""
    plugins = [{"type": "healthy"}, {"type": "model"}, *(s for s, _ in scorers), picker]
    refs = [{"ref": "healthy"}, {"ref": "model"}]
    refs += [{"ref": s.get("name", s["type"]), "weight": w} for s, w in scorers]
    return {
        "plugins": plugins,
        "profiles": [{"name": "default", "plugins": [*refs, {"ref": picker["type"]}]}],
    }


_ARGMIN = {"type": "max-score", "parameters": {"tolerance": 0}}  # ties at random, as both do

#: name → (preset, config); a config with ``plugins`` has no preset ("").
ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "exact": ("prefix-aware", {"prefix": _ENGINE_TOKENS}),
    # the engine's tokens computed in the gateway (needs --tokenizer: the engines tokenize the same way)
    "exact-local": (
        "prefix-aware",
        {"prefix": {"exact": "auto", "kv_events": {"tokenizer": {"path": None}}}},
    ),
    # next turns matched on the previous turn's tokens, /tokenize in the background
    "exact-reuse-turns": (
        "prefix-aware",
        {"prefix": {"exact": "auto", "kv_events": {"reuse_turn_tokens": True}}},
    ),
    # exact-local with every encode past 2,048 new characters in the thread pool (the old default)
    "exact-local-pool": (
        "prefix-aware",
        {"prefix": {"exact": "auto", "kv_events": {"tokenizer": {"path": None, "inline_chars": 2048}}}},
    ),
    "approximate": ("prefix-aware", {"prefix": {"exact": "off"}}),
    # the approximate index in Redis: what several gateways share without KV events
    "approximate-redis": ("prefix-aware", {"prefix": {"exact": "off", "backend": "redis"}}),
    # the same with a 25 ms budget per Redis call instead of the 5 ms default (a loaded host)
    "approximate-redis-25ms": (
        "prefix-aware",
        {"prefix": {"exact": "off", "backend": "redis", "redis_budget_s": 0.025}},
    ),
    "round-robin": ("round-robin", {"prefix": {"exact": "off"}}),
    "dynamo-cost": (
        "",
        {"prefix": _ENGINE_TOKENS, **_profile(_ARGMIN, ({"type": "kv-block-cost"}, 1))},
    ),
    # the same with the decode term from the engine's scraped KV usage (unique blocks, outputs included)
    "dynamo-cost-engine": (
        "",
        {
            "prefix": _ENGINE_TOKENS,
            **_profile(_ARGMIN, ({"type": "kv-block-cost", "parameters": {"active_blocks": "engine"}}, 1)),
        },
    ),
    "llm-d-weights": (
        "",
        {
            "prefix": _ENGINE_TOKENS,
            **_profile(
                _ARGMIN,
                ({"type": "prefix-affinity", "parameters": {"normalize": "min-max"}}, 3),
                ({"type": "kv-utilization"}, 2),
                ({"type": "queue-depth"}, 2),
            ),
        },
    ),
}
# Dynamo's cost with a heavier prefill weight (its docs: raise it for TTFT-bound work), to tell
# its form from its default weight
for _weight in (4, 16):
    ARMS[f"dynamo-cost-w{_weight}"] = (
        "",
        {
            "prefix": _ENGINE_TOKENS,
            **_profile(
                _ARGMIN, ({"type": "kv-block-cost", "parameters": {"overlap_score_weight": _weight}}, 1)
            ),
        },
    )
# prefix-aware's scorers with a heavier in-flight term (decode_weight, default 48 tokens a
# request): how much of the tail is load concentrated on the replica that holds the prefix
for _decode in (150, 400):
    ARMS[f"exact-dw{_decode}"] = (
        "",
        {
            "prefix": _ENGINE_TOKENS,
            **_profile(
                {"type": "max-score", "parameters": {"tolerance": 0.02}},
                ({"type": "prefix-cost", "parameters": {"decode_weight": _decode}}, 1),
                ({"type": "cache-room"}, 0.1),
                ({"type": "lora-affinity"}, 1),
            ),
        },
    )
PEERS = {"sglang-router": "sglang-router:cache_aware"}
IDEAL = "ideal"
IDEAL_SIM_BLOCKS = 1_000_000
_LOCAL_TOKENS_TOO = (
    "exact-local",
    "exact-local-pool",
    "exact-dw150",
    "exact-dw400",
    "llm-d-weights",
    *(name for name in ARMS if name.startswith("dynamo-cost")),
)


_PENDING_SUFFIXES = {"-no-pending": False, "-pending": True}


def arm_names() -> list[str]:
    """Every gateway arm, and the pending-blocks variants of those with the exact index."""
    names = list(ARMS)
    for name, (_, config) in ARMS.items():
        if config["prefix"].get("exact") != "off":
            names += [name + suffix for suffix in _PENDING_SUFFIXES]
    return names


def arm_config(name: str, tokenizer: str) -> tuple[str, dict[str, Any]]:
    """The arm's preset and config, with the local tokenizer directory where it applies."""
    for suffix, on in _PENDING_SUFFIXES.items():
        if name.endswith(suffix) and name[: -len(suffix)] in ARMS:
            policy, config = arm_config(name[: -len(suffix)], tokenizer)
            prefix = dict(config["prefix"])
            prefix["kv_events"] = {**prefix.get("kv_events", {}), "pending_blocks": on}
            return policy, {**config, "prefix": prefix}
    policy, config = ARMS[name]
    if name.startswith("exact-local") and not tokenizer:
        raise SystemExit(f"{name} needs --tokenizer (the engines must tokenize as the gateway)")
    if name in _LOCAL_TOKENS_TOO and tokenizer:
        own = config["prefix"].get("kv_events", {}).get("tokenizer", {})
        inline = {"inline_chars": own["inline_chars"]} if "inline_chars" in own else {}
        local = {"exact": "auto", "kv_events": {"tokenizer": {"path": tokenizer, **inline}}}
        config = {**config, "prefix": local}
    return policy, config


@dataclass
class Front:
    """What the clients talk to in one arm (one URL per gateway instance), and whether it
    predicts cached tokens."""

    urls: list[str]
    stop: Callable[[], Awaitable[None]]
    predicts: bool = True
    pids: list[int] = field(default_factory=list)  # the gateway processes (their CPU is read)

    @property
    def url(self) -> str:
        return self.urls[0]


async def _nothing() -> None:
    return None


async def start_front(name: str, urls: list[str], args: argparse.Namespace, workdir: Path) -> Front:
    """The arm's router in front of ``urls`` (``ideal``: the one replica itself); a gateway arm
    runs ``args.gateways`` independent gateway processes (each its own index and subscribers)."""
    if name == IDEAL:
        return Front([urls[0]], _nothing, predicts=False)
    if name in PEERS:
        peer = await start_router(PEERS[name], urls, log_dir=workdir)
        return Front([peer.url], peer.stop, predicts=False)
    policy, config = arm_config(name, args.tokenizer)
    if config["prefix"].get("backend") == "redis":  # no blocks left over from an earlier arm
        config = {**config, "prefix": {**config["prefix"], "key_prefix": f"bench-{uuid.uuid4().hex[:12]}"}}
    config_path = workdir / f"{name}.json"
    config_path.write_text(json.dumps(config))
    preset = ["--policy", policy] if policy else []
    gateways = []
    try:
        for index in range(getattr(args, "gateways", 1)):
            gateways.append(
                await start_gateway(
                    urls, ["--config", str(config_path), *preset], name=f"gateway-{index}", log_dir=workdir
                )
            )
    except BaseException:
        for gateway in gateways:
            await gateway.stop()
        raise

    async def stop() -> None:
        for gateway in gateways:
            await gateway.stop()

    return Front([g.url for g in gateways], stop, pids=[g.pid for g in gateways])
