"""Frozen, validated settings that cross module boundaries."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from backend.policies import EVICTION_POLICIES, EXPERT_BACKENDS, policy_fields

GRAMMAR_KINDS = ("json_schema", "lark", "gbnf", "regex")


@dataclass(frozen=True)
class Grammar:
    """What a reply must match: a JSON schema (as JSON text), a Lark grammar (llguidance's
    dialect), a GBNF grammar (llama.cpp's; converted to Lark) or a regular expression."""

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(
                f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError("a grammar needs a non-empty source")


# Stop strings a request may carry: matching costs the engine thread time per token.
MAX_STOPS = 16
MAX_STOP_CHARS = 4096


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
    grammar: Grammar | None = None  # constrained decoding (backend/text/grammar.py)

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
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if len(self.stop) > MAX_STOPS:
            raise ValueError(f"stop takes at most {MAX_STOPS} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters long")

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


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1") != "0"


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model. Validated here; model-dependent limits in the engine."""

    device: str = "cpu"
    storage: str = (
        "ssd"  # "ssd": experts read from the model file with O_DIRECT; "host": all in RAM
    )
    cache: str = "0.3"  # fraction, percentage, count or size (see parse_cache_size)
    # "lfu", "lru" or "reuse" (see backend/engine/cache.py). "reuse" fetches fewer experts,
    # but its bookkeeping runs on the engine thread between jobs, so it pays only where a
    # fetch is long against that Python (docs/performance.md has both measured).
    eviction: str = "lfu"
    policy: str = "bevy"
    max_active: int = 16  # requests running at once; more wait in the admission queue
    kv_budget_mib: int = 2048
    # Stored slots: dequantized weights of recently used cached experts, held inside the
    # cache budget (fewer slots). None or 0: none (what measured best; see the engine).
    working_set_mib: int | None = None
    # What a cache slot holds: "stored" (the expert's quantized bytes; compute reads them
    # directly for few rows, else dequantizes on use with a small working set of decoded
    # experts) or "decoded" (weights dequantized once by the link as part of the fetch;
    # slots are then several times larger).
    # "auto" is "stored": decoding on the link thread takes a core from compute.
    slot_format: str = "auto"
    metrics_interval_s: float = 0.1
    # Chunked prefill: a prompt longer than this many tokens is read in parts, layer by
    # layer: the MoE a few experts at a time (about this many rows' routes each) on all
    # of its rows, then the rest in slices of this many rows, with other requests' jobs
    # run between parts so that one long prompt does not stall every chat. 0: each
    # prompt's layer in one job. Policies that move requests together (sync,
    # prefetch-*, bevy-static) never slice.
    prefill_chunk: int = 512
    # How experts are computed: "auto" (chosen at start from the device, the slot format,
    # the experts' block types and what builds) or one of EXPERT_BACKENDS, which must
    # be able to run (backend/engine/experts/).
    expert_backend: str = "auto"
    # What may be used at all; the environment gives the defaults. ``native``: the
    # hand-written CPU kernels for experts; ``compile``: Inductor graphs for experts (and
    # with it the native ones, which need the same toolchain); ``aio``: Linux native AIO
    # for batched expert reads (else one read per part).
    native: bool = field(default_factory=lambda: _env_on("BEVY_NATIVE") and _env_on("BEVY_COMPILE"))
    compile: bool = field(default_factory=lambda: _env_on("BEVY_COMPILE"))
    aio: bool = field(default_factory=lambda: _env_on("BEVY_AIO"))

    def __post_init__(self) -> None:
        if self.expert_backend not in EXPERT_BACKENDS:
            raise ValueError(
                f"expert_backend must be one of {', '.join(EXPERT_BACKENDS)}, got {self.expert_backend!r}"
            )
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
        if self.working_set_mib is not None and self.working_set_mib < 0:
            raise ValueError(f"working_set_mib must be >= 0, got {self.working_set_mib}")
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {self.prefill_chunk}")
        if self.kv_budget_mib < 1:
            raise ValueError(f"kv_budget_mib must be >= 1, got {self.kv_budget_mib}")
        policy_fields(self.policy)  # raises ValueError naming the known policies
