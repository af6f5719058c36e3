"""``llm-gateway plan``: a memory-floor fleet size for a model, precision and concurrency.

Weights decide the replica, KV caches decide the fleet. The rules (the capacity seed's):

* usable memory per GPU = ``gpu_mem_gb`` × ``usable`` (default 80 GB × 0.9 = 72 GB);
* weights = parameters × bytes per parameter (bf16 2, fp8 1);
* GPUs per replica = the smallest power of two whose usable memory holds the weights
  *and* at least ``min_conversations`` (default 8) full-context KV caches;
* KV per conversation = context tokens × KV bytes per token (fp8 KV halves it);
* conversations per replica = floor((replica usable − weights) / KV per conversation);
* replicas = ceil(users / conversations per replica); GPUs = replicas × GPUs per replica.

Unit conventions, chosen because they are the only ones that reproduce every number
in the seed (checked in tests/plan/test_planner.py):

* GB is decimal (10⁹ bytes) for GPU memory and weights: "80 GB GPUs", "141 GB".
  Reading 80 GB as GiB gives 62 conversations per bf16 Llama 3 70B replica, not 54.
* Weights use the published (rounded-to-0.1B) parameter count, not the name: Llama 3
  70B is 70.6B (bf16 141.2 GB, shown as 141 GB; with a flat 70B a replica holds 55
  conversations, not 54). The exact 70,553,706,496 gives the same answers.
  DeepSeek-V3 is 671B (the served model without its 14B multi-token-prediction module).
* KV bytes per token are binary (KiB) and exact: 2 (K and V) × layers × KV heads ×
  head dim × bytes, i.e. 128 KiB (8B), 320 KiB (70B), 504 KiB (405B) in bf16.
  DeepSeek-V3's MLA caches one 512-wide latent + 64-wide RoPE key per layer:
  61 × 576 × 2 = 70,272 B = 68.625 KiB, the seed's "about 69". The exact figure gives
  its 835 conversations per replica; a flat 69 KiB would give 831.
* "8k tokens" of context is 8,192.

The result is a floor: it ignores activations, CUDA graphs, fragmentation and the
throughput / latency SLOs a load test must still confirm. ``--live URL`` sizes against a
running gateway's observed load instead (:mod:`gateway.plan.live`); the command line
is :mod:`gateway.plan.cli`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

__all__ = [
    "DTYPE_BYTES",
    "PRESETS",
    "ModelSpec",
    "Parallelism",
    "Plan",
    "PlanError",
    "PlanRequest",
    "compare",
    "dense_model",
    "kv_bytes_per_token",
    "plan",
]

GB = 10**9
_MAX_GPU_MEM_GB = 1e6  # a petabyte per GPU: past any real device, and past it the sums overflow
_MAX_PARAMS_B = 1e6  # a quadrillion parameters
KIB = 1024
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp8": 1}
MAX_GPUS_PER_REPLICA = 1024  # 128 eight-GPU nodes: beyond this, the plan is not a memory question
COMPARE_PRECISIONS: tuple[tuple[str, str], ...] = (
    ("bf16", "bf16"),
    ("fp8", "bf16"),
    ("bf16", "fp8"),
    ("fp8", "fp8"),
)


class PlanError(ValueError):
    """Input the planner cannot size: the CLI prints it and exits 2."""


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_element: int = 2) -> int:
    """Standard (GQA/MHA) attention caches one K and one V vector per KV head per layer."""
    return 2 * layers * kv_heads * head_dim * bytes_per_element


@dataclass(frozen=True)
class ModelSpec:
    """What sizing needs from a model: its parameter count and its bf16 KV bytes per token."""

    name: str
    params_b: float
    kv_bytes_per_token_bf16: int
    moe: bool = False
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None

    @property
    def params(self) -> int:
        return round(self.params_b * GB)


def dense_model(params_b: float, layers: int, kv_heads: int, head_dim: int, name: str = "") -> ModelSpec:
    """A dense GQA/MHA model described by its shape (``--params-b --layers --kv-heads --head-dim``)."""
    for label, value in (("--params-b", params_b), ("--layers", layers), ("--kv-heads", kv_heads)):
        if not value or not math.isfinite(value) or value <= 0:
            raise PlanError(f"{label} must be a positive number, got {value}")
    if not head_dim or head_dim <= 0:
        raise PlanError(f"--head-dim must be positive, got {head_dim}")
    return ModelSpec(
        name=name or f"custom {params_b:g}B dense",
        params_b=params_b,
        kv_bytes_per_token_bf16=kv_bytes_per_token(layers, kv_heads, head_dim),
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )


PRESETS: dict[str, ModelSpec] = {
    "llama-3-8b": dense_model(8.03, layers=32, kv_heads=8, head_dim=128, name="Llama 3 8B"),
    "llama-3-70b": dense_model(70.6, layers=80, kv_heads=8, head_dim=128, name="Llama 3 70B"),
    "llama-3-405b": dense_model(405.9, layers=126, kv_heads=8, head_dim=128, name="Llama 3 405B"),
    # MLA: per layer one compressed latent (kv_lora_rank 512) + decoupled RoPE key (64), no V.
    "deepseek-v3": ModelSpec(
        name="DeepSeek-V3", params_b=671.0, kv_bytes_per_token_bf16=61 * (512 + 64) * 2, moe=True, layers=61
    ),
}


@dataclass(frozen=True)
class PlanRequest:
    """The question: this model, at these precisions, for this many full-context conversations."""

    model: ModelSpec
    weights: str = "bf16"
    kv_dtype: str = "bf16"
    context: int = 8192
    users: int = 1000
    gpu_mem_gb: float = 80.0
    usable: float = 0.9
    min_conversations: int = 8
    gpus_per_node: int = 8

    def validate(self) -> None:
        """Reject what would make the arithmetic meaningless rather than return a silly plan."""
        if self.weights not in DTYPE_BYTES:
            raise PlanError(
                f"unknown weight precision {self.weights!r} (choose from {', '.join(DTYPE_BYTES)})"
            )
        if self.kv_dtype not in DTYPE_BYTES:
            raise PlanError(f"unknown KV precision {self.kv_dtype!r} (choose from {', '.join(DTYPE_BYTES)})")
        if self.context < 1:
            raise PlanError(f"--context must be at least 1 token, got {self.context}")
        if self.users < 1:
            raise PlanError(f"--users must be at least 1 concurrent conversation, got {self.users}")
        if not (0 < self.gpu_mem_gb <= _MAX_GPU_MEM_GB):  # NaN fails it too; 1e300 overflowed later
            raise PlanError(
                f"--gpu-mem-gb must be a positive number up to {_MAX_GPU_MEM_GB:g}, got {self.gpu_mem_gb}"
            )
        if not 0 < self.usable <= 1:
            raise PlanError(f"--usable must be in (0, 1], got {self.usable}")
        if self.min_conversations < 1:
            raise PlanError(f"--min-conversations must be at least 1, got {self.min_conversations}")
        if self.gpus_per_node < 1:
            raise PlanError(f"--gpus-per-node must be at least 1, got {self.gpus_per_node}")
        if not (0 < self.model.params_b <= _MAX_PARAMS_B) or self.model.kv_bytes_per_token_bf16 <= 0:
            raise PlanError(
                f"model {self.model.name!r} needs a positive parameter count (up to {_MAX_PARAMS_B:g} B)"
                " and KV size"
            )


@dataclass(frozen=True)
class Parallelism:
    """How one replica's GPUs split the model (seed 004: TP in a node, PP across nodes, EP for MoE)."""

    tp: int
    pp: int
    ep: int
    nodes_per_replica: int
    dp: int
    advice: str


@dataclass(frozen=True)
class Plan:
    """The answer, in bytes internally and GB (10⁹) at the edges."""

    request: PlanRequest
    weights_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_conversation: int
    gpus_per_replica: int
    replica_usable_bytes: int
    conversations_per_replica: int
    replicas: int
    total_gpus: int
    binding: str
    explanation: str
    parallelism: Parallelism = field(repr=False)

    @property
    def weights_gb(self) -> float:
        return self.weights_bytes / GB

    @property
    def kv_space_bytes(self) -> int:
        return self.replica_usable_bytes - self.weights_bytes

    @property
    def weights_share(self) -> float:
        """Fraction of the replica's usable memory the weights take; above 0.5 the weights bind."""
        return self.weights_bytes / self.replica_usable_bytes

    def to_dict(self) -> dict[str, Any]:
        req = self.request
        return {
            "model": req.model.name,
            "params_b": req.model.params_b,
            "moe": req.model.moe,
            "weights_dtype": req.weights,
            "kv_dtype": req.kv_dtype,
            "context": req.context,
            "users": req.users,
            "gpu_mem_gb": req.gpu_mem_gb,
            "usable": req.usable,
            "min_conversations": req.min_conversations,
            "weights_gb": round(self.weights_gb, 3),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_per_conversation_gb": round(self.kv_bytes_per_conversation / GB, 4),
            "replica_usable_gb": round(self.replica_usable_bytes / GB, 3),
            "kv_space_per_replica_gb": round(self.kv_space_bytes / GB, 3),
            "weights_share": round(self.weights_share, 4),
            "gpus_per_replica": self.gpus_per_replica,
            "conversations_per_replica": self.conversations_per_replica,
            "replicas": self.replicas,
            "total_gpus": self.total_gpus,
            "binding": self.binding,
            "explanation": self.explanation,
            "parallelism": asdict(self.parallelism),
        }


def _parallelism(model: ModelSpec, gpus: int, replicas: int, gpus_per_node: int) -> Parallelism:
    """Split just enough to fit: TP inside an NVLink node, PP (or EP for MoE) across nodes."""
    tp = min(gpus, gpus_per_node)
    pp = -(-gpus // tp)
    fleet = f"{replicas} data-parallel replica{'s' if replicas != 1 else ''} behind the router"
    if gpus == 1:
        advice = f"one GPU per replica, no model parallelism; {fleet}"
    elif pp == 1:
        advice = f"TP={tp} within one NVLink node; {fleet}"
    else:
        advice = (
            f"TP={tp} within each node x PP={pp} across {pp} nodes (keep TP's per-layer all-reduce "
            f"off the inter-node link); {fleet}"
        )
    if model.moe and gpus > 1:
        advice += f"; MoE: expert parallelism EP={gpus} over the replica's GPUs (DP attention + EP)"
    if model.kv_heads and tp > model.kv_heads:
        advice += f"; TP={tp} > {model.kv_heads} KV heads replicates KV heads, so real KV room is lower"
    return Parallelism(
        tp=tp, pp=pp, ep=gpus if model.moe else 1, nodes_per_replica=pp, dp=replicas, advice=advice
    )


def plan(request: PlanRequest) -> Plan:
    """Size the replica from the weights, then the fleet from the conversations' KV caches."""
    request.validate()
    model = request.model
    weights = model.params * DTYPE_BYTES[request.weights]
    kv_token = model.kv_bytes_per_token_bf16 * DTYPE_BYTES[request.kv_dtype] // DTYPE_BYTES["bf16"]
    kv_conv = request.context * kv_token
    per_gpu = round(request.gpu_mem_gb * GB * request.usable)
    needed = weights + request.min_conversations * kv_conv
    gpus = 1
    while gpus * per_gpu < needed:
        gpus *= 2
        if gpus > MAX_GPUS_PER_REPLICA:
            raise PlanError(
                f"{model.name} in {request.weights} with {request.min_conversations} conversations of "
                f"{request.context:,} tokens does not fit on {MAX_GPUS_PER_REPLICA} GPUs of "
                f"{request.gpu_mem_gb:g} GB"
            )
    usable = gpus * per_gpu
    conversations = (usable - weights) // kv_conv
    replicas = -(-request.users // conversations)
    binding = "weights" if weights > usable - weights else "kv_cache"
    share = weights / usable
    if binding == "weights":
        explanation = (
            f"weights bind: {weights / GB:,.0f} GB of weights take {share:.0%} of each {gpus}-GPU replica's "
            f"{usable / GB:,.0f} GB, leaving {(usable - weights) / GB:,.0f} GB for {conversations:,} "
            f"conversations; the fleet grows in whole {gpus}-GPU replicas whose size the weights set"
        )
    else:
        explanation = (
            f"KV cache binds: KV caches get {1 - share:.0%} of each {gpus}-GPU replica's "
            f"{usable / GB:,.0f} GB ({conversations:,} conversations x {kv_conv / GB:.2f} GB); "
            f"shrinking the weights shrinks the replica but not the fleet's KV need"
        )
    return Plan(
        request=request,
        weights_bytes=weights,
        kv_bytes_per_token=kv_token,
        kv_bytes_per_conversation=kv_conv,
        gpus_per_replica=gpus,
        replica_usable_bytes=usable,
        conversations_per_replica=conversations,
        replicas=replicas,
        total_gpus=replicas * gpus,
        binding=binding,
        explanation=explanation,
        parallelism=_parallelism(model, gpus, replicas, request.gpus_per_node),
    )


def compare(request: PlanRequest) -> list[Plan]:
    """The same question at each weights/KV precision pair, to show what quantising actually buys."""
    return [plan(replace(request, weights=w, kv_dtype=kv)) for w, kv in COMPARE_PRECISIONS]


# --- command line ---------------------------------------------------------------------------------
