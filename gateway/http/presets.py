"""The built-in routing presets (``--policy NAME``) and the P/D default, as plugin specs.

Wiring, not framework: the scheduler framework knows no plugin by name; these presets
name the in-tree plugins of :mod:`policies`.
"""

from __future__ import annotations

import logging

from gateway.config import ConfigError, GatewayConfig, PluginSpec, ProfilePluginRef, ProfileSpec

__all__ = ["DEFAULT_POLICY", "PRESETS", "pd_preset", "preset", "scheduler_specs"]

log = logging.getLogger(__name__)

# A plain preset never sends a client's request to a prefill replica: with an explicit policy
# (no P/D profiles) those take prefill legs only, and there are none.
_BASE_FILTERS = (
    PluginSpec(type="healthy"),
    PluginSpec(type="model"),
    PluginSpec(type="role", name="serving", parameters={"roles": ["decode", "both"]}),
)
_TIE_BREAK = PluginSpec(type="max-score", parameters={"tolerance": 0.02})


def _preset(
    picker: PluginSpec, *scorers: tuple[PluginSpec, float]
) -> tuple[list[PluginSpec], list[ProfileSpec]]:
    """One profile: the base filters, the weighted scorers, the picker."""
    plugins = [*_BASE_FILTERS, *(spec for spec, _ in scorers), picker]
    refs = [
        *(ProfilePluginRef(ref=f.instance_name) for f in _BASE_FILTERS),
        *(ProfilePluginRef(ref=spec.instance_name, weight=weight) for spec, weight in scorers),
        ProfilePluginRef(ref=picker.instance_name),
    ]
    return plugins, [ProfileSpec(name="default", plugins=refs)]


# Named presets: what `--policy NAME` means without a config file.
PRESETS: dict[str, tuple[list[PluginSpec], list[ProfileSpec]]] = {
    "round-robin": _preset(PluginSpec(type="round-robin")),
    "random": _preset(PluginSpec(type="random")),
    "least-load": _preset(
        PluginSpec(type="max-score"),
        (PluginSpec(type="queue-depth"), 1),
        (PluginSpec(type="kv-utilization"), 1),
        (PluginSpec(type="in-flight"), 1),
    ),
    # Expected-cost routing: prefix hits against queued work; cache room breaks cold ties; a LoRA
    # adapter's requests go where it runs (neutral for base models; docs/benchmarks.md §10).
    "prefix-aware": _preset(
        _TIE_BREAK,
        (PluginSpec(type="prefix-cost"), 1),
        (PluginSpec(type="cache-room"), 0.1),
        (PluginSpec(type="lora-affinity"), 1),
    ),
    # prefix-aware plus session stickiness: a conversation stays on its replica while it has room;
    # new (and moving) sessions go where the fewest live sessions are (docs/benchmarks.md §10).
    "session-aware": _preset(
        _TIE_BREAK,
        (PluginSpec(type="prefix-cost"), 1),
        (PluginSpec(type="cache-room"), 0.1),
        (PluginSpec(type="session-affinity"), 0.5),
        (PluginSpec(type="session-balance"), 1),
    ),
    # prefix-aware plus the learned latency against each request's TTFT objective: replicas
    # predicted to miss it lose; prefix-cost keeps spreading load among those that meet it.
    "slo-aware": _preset(
        _TIE_BREAK,
        (PluginSpec(type="slo-headroom"), 1),
        (PluginSpec(type="prefix-cost"), 1),
        (PluginSpec(type="cache-room"), 0.1),
    ),
}
DEFAULT_POLICY = "prefix-aware"


def pd_preset(config: GatewayConfig) -> tuple[list[PluginSpec], list[ProfileSpec]]:
    """Two pools: decode (prefix cost, session affinity) and prefill (prefix cost), under ``pd-disagg``."""
    plugins = [
        *_BASE_FILTERS,
        PluginSpec(type="role", name="decode-pool", parameters={"roles": ["decode", "both"]}),
        PluginSpec(type="role", name="prefill-pool", parameters={"roles": ["prefill"]}),
        PluginSpec(type="prefix-cost"),
        PluginSpec(type="session-affinity"),
        PluginSpec(type="kv-utilization"),
        _TIE_BREAK,
        PluginSpec(
            type="pd-disagg",
            parameters={
                "decider": config.pd.decider,
                "threshold_tokens": config.pd.threshold_tokens,
                "fallback_to_decode": config.pd.fallback_to_decode,
                "protocol": config.pd.protocol,
            },
        ),
    ]
    common = [ProfilePluginRef(ref="healthy"), ProfilePluginRef(ref="model")]
    decode = ProfileSpec(
        name="decode",
        plugins=[
            *common,
            ProfilePluginRef(ref="decode-pool"),
            ProfilePluginRef(ref="prefix-cost", weight=1),
            ProfilePluginRef(ref="kv-utilization", weight=0.2),
            ProfilePluginRef(ref="session-affinity", weight=0.5),
            ProfilePluginRef(ref="max-score"),
        ],
    )
    prefill = ProfileSpec(
        name="prefill",
        plugins=[
            *common,
            ProfilePluginRef(ref="prefill-pool"),
            ProfilePluginRef(ref="prefix-cost", weight=1),
            ProfilePluginRef(ref="max-score"),
        ],
    )
    return plugins, [decode, prefill]


def preset(name: str) -> tuple[list[PluginSpec], list[ProfileSpec]]:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"policy: unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})") from None


def scheduler_specs(config: GatewayConfig) -> tuple[list[PluginSpec], list[ProfileSpec]]:
    """What the config asks for: its own plugins, else the P/D preset for a fleet with a
    prefill pool, else the named (or default) preset."""
    if config.plugins:
        return list(config.plugins), list(config.profiles)
    has_prefill = any(e.role == "prefill" for e in config.endpoints)
    if has_prefill and config.policy is None:
        return pd_preset(config)
    if has_prefill:
        log.warning(
            "policy %r with prefill endpoints: no prefill/decode disaggregation (that is the default"
            " policy's), the prefill replicas get no requests",
            config.policy,
        )
    return preset(config.policy or DEFAULT_POLICY)
