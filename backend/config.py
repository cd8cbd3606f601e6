"""Frozen, validated settings that cross module boundaries."""

from __future__ import annotations

import math
from dataclasses import dataclass

from backend.policies import EVICTION_POLICIES, policy_fields


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. temperature 0 means greedy."""

    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 512
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: always generate max_tokens

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 10.0):
            raise ValueError(f"temperature must be between 0 and 10, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def parse_cache_size(spec: str | float | int, n_experts: int, slot_bytes: int) -> int:
    """Slots for a cache given as a fraction ("0.3", "30%"), a count ("288"), or "512MiB"/"2GiB"."""
    s = str(spec).strip()
    try:
        if s.endswith("%"):
            return max(0, round(float(s[:-1]) / 100 * n_experts))
        for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("GB", 10**9), ("MB", 10**6)):
            if s.endswith(unit):
                return int(float(s[: -len(unit)]) * scale) // slot_bytes
        if "." in s or "e" in s.lower():
            frac = float(s)
            if not 0 < frac <= 1:
                raise ValueError
            return max(0, round(frac * n_experts))
        return int(s)
    except ValueError:
        raise ValueError(
            f"cache size {spec!r} is not a fraction (0.3), a percentage (30%), a count (288) or a size (512MiB)"
        ) from None


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model. Validated here; model-dependent limits in the engine."""

    device: str = "cpu"
    storage: str = (
        "ssd"  # "ssd": experts read from the model file with O_DIRECT; "host": all in RAM
    )
    cache: str = "0.3"  # fraction, percentage, count or size (see parse_cache_size)
    # "lfu", "lru" or "reuse" (see backend/engine/cache.py). Under bevy on the demo, "reuse"
    # fetched 2-11 % fewer experts than LFU (and within 5 % of sync at every cache size),
    # but its bookkeeping runs on the engine thread between jobs: on the 2-core CPU we
    # measured, tokens/s went from +7 % (8 requests, 10 % cache) to -13 % (16 requests,
    # 30 %) side by side with LFU. It pays where a fetch is long against that Python.
    eviction: str = "lfu"
    policy: str = "bevy"
    max_active: int = 16  # requests running at once; more wait in the admission queue
    kv_budget_mib: int = 2048
    working_set_mib: int = 768  # stored slots: dequantized weights of recently used cached experts
    # What a cache slot holds: "stored" (the expert's quantized bytes; compute reads them
    # directly for few rows, else dequantizes on use with a small working set of decoded
    # experts) or "decoded" (weights dequantized once by the link as part of the fetch;
    # slots are then several times larger).
    # "auto" is "stored": on the 2-core CPU we measured, decoding on the link thread took
    # a core from compute and lost more than it saved.
    slot_format: str = "auto"
    metrics_interval_s: float = 0.1

    def __post_init__(self) -> None:
        if self.storage not in ("ssd", "host"):
            raise ValueError(f"storage must be 'ssd' or 'host', got {self.storage!r}")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {self.eviction!r}"
            )
        if self.max_active < 1:
            raise ValueError(f"max_active must be >= 1, got {self.max_active}")
        if self.slot_format not in ("auto", "stored", "decoded"):
            raise ValueError(
                f"slot_format must be 'auto', 'stored' or 'decoded', got {self.slot_format!r}"
            )
        if self.working_set_mib < 0:
            raise ValueError(f"working_set_mib must be >= 0, got {self.working_set_mib}")
        if self.kv_budget_mib < 1:
            raise ValueError(f"kv_budget_mib must be >= 1, got {self.kv_budget_mib}")
        policy_fields(self.policy)  # raises ValueError naming the known policies
