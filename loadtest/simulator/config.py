"""Simulator configuration.

Defaults are modelled on Llama-3.1-8B served by vLLM on one H100: ~6 ms base
step, ~25 us per prefill token (range 17-60 us observed), and a small per-KV-token
attention cost, which gives an ITL of ~7-15 ms at small batch sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENGINES = ("vllm", "sglang")
ROLES = ("both", "prefill", "decode")


@dataclass
class SimConfig:
    """Everything that shapes one simulated replica."""

    host: str = "127.0.0.1"
    port: int = 8001
    engine: str = "vllm"  # "vllm" | "sglang"
    role: str = "both"  # "both" | "prefill" | "decode"
    model: str = "sim-llama"
    kv_blocks: int = 2048
    block_size: int = 16
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    time_scale: float = 1.0  # X means everything runs X times faster
    decode_step_ms: float = 6.0
    prefill_us_per_token: float = 25.0
    decode_us_per_kv_token: float = 0.05
    seed: int = 0
    default_max_tokens: int = 64
    pd_ttl_s: float = 30.0  # how long a prefill's KV stays claimable by a decode replica
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" (vLLM's --scheduling-policy)
    # vLLM's --max-model-len: prompt + output limit per request. The default is what the default
    # KV cache (kv_blocks x block_size) can hold, the largest value vLLM would start with.
    max_model_len: int = 32768
    # vLLM's --shutdown-timeout: on SIGTERM, seconds to let in-flight requests finish before the
    # rest are aborted. 0 (vLLM's default) aborts them at once.
    shutdown_timeout_s: float = 0.0
    # vLLM's --kv-events-config: publish KV events (ZMQ PUB + replay ROUTER; 0 = any free port).
    kv_events: bool = False
    kv_events_port: int = 0
    kv_events_replay_port: int = 0
    kv_events_topic: str = "kv-events"
    # vLLM's --data-parallel-size: N schedulers with their own KV caches behind this port (dp.py)
    data_parallel_size: int = 1

    # vLLM's --enable-lora / --max-loras / --lora-modules name=path ...; lora_load_ms: the modelled
    # cost of loading an adapter that is not resident in the GPU slots (loadtest.simulator.lora).
    enable_lora: bool = False
    max_loras: int = 1
    lora_modules: tuple[str, ...] = field(default_factory=tuple)
    lora_load_ms: float = 50.0

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.lora_load_ms < 0:
            raise ValueError("max_loras must be at least 1 and lora_load_ms not negative")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (vLLM: --lora-modules needs --enable-lora)")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.kv_blocks <= 0 or self.block_size <= 0:
            raise ValueError("kv_blocks and block_size must be positive")
        if self.max_num_seqs <= 0 or self.max_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_batched_tokens must be positive")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        if self.max_model_len <= 1:
            raise ValueError("max_model_len must be at least 2")
        if self.data_parallel_size < 1:
            raise ValueError("data_parallel_size must be at least 1")
        if self.shutdown_timeout_s < 0:
            raise ValueError("shutdown_timeout_s must not be negative")
