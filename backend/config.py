"""Frozen, validated settings that cross module boundaries."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from backend.policies import EVICTION_POLICIES, EXPERT_BACKENDS, KV_TYPES, policy_fields

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
        if s.endswith("B"):
            return parse_size(s) // slot_bytes
        if "." in s or "e" in s.lower():
            frac = float(s)
            if not 0 < frac <= 1:
                raise ValueError
            return max(0, round(frac * n_experts))
        return int(s)
    except ValueError:
        raise ValueError(
            f"cache size {spec!r} is not auto, a fraction (0.3), a percentage (30%), "
            "a count (288) or a size (512MiB)"
        ) from None


AUTO = "auto"
# What "auto" leaves free for the rest of the machine (the desktop, a browser, the page
# cache): a tenth of the RAM, at least 1 GiB; llama.cpp's --fit leaves 1 GiB per device.
_HEADROOM_MIN = 1 << 30
_KV_DEFAULT = 2048 << 20  # KV budget where memory is not short (--kv-budget overrides)
_KV_MIN = 64 << 20  # and where it is: a few thousand tokens of a small model's context


def parse_size(spec: str | int, whole: int | None = None) -> int:
    """Bytes for "512MiB", "2GiB", "1.5GB", "800MB" or a byte count; "60%" of ``whole``
    where that is given."""
    s = str(spec).strip()
    try:
        if s.endswith("%") and whole is not None:
            pct = float(s[:-1])
            if not 0 < pct <= 100:
                raise ValueError
            return int(pct / 100 * whole)
        for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("GB", 10**9), ("MB", 10**6)):
            if s.endswith(unit):
                value = float(s[: -len(unit)])
                if not (math.isfinite(value) and value > 0):
                    raise ValueError
                return int(value * scale)
        if int(s) > 0:
            return int(s)
        raise ValueError
    except ValueError:
        share = ", 60% (of the RAM)" if whole is not None else ""
        raise ValueError(f"memory size {spec!r} is not a size: 4GiB, 4096MiB, 4GB{share}") from None


@dataclass(frozen=True)
class MemoryPlan:
    """What the engine holds for a model under the user's budget: cache slots, the KV
    budget admission keeps to, and the total it was planned within (0: no total, an
    explicit ``--cache``). ``note`` says which, for logs and the status bar. Within a
    total, KV room that no running request holds may hold cache slots meanwhile
    (``shared``), given back as requests need it."""

    slots: int
    kv_bytes: int
    total_bytes: int
    note: str
    shared: bool = False


def system_memory() -> tuple[int, int]:
    """(total, available) bytes of RAM: what the OS would give without swapping, within
    the process's memory cgroup's limit where it has one (a container's, say), which
    psutil does not see."""
    import psutil

    from backend.cgroup import memory_limit

    vm = psutil.virtual_memory()
    total, available = vm.total, vm.available
    limit = memory_limit()
    if limit is not None:
        limit_bytes, used = limit
        total, available = min(total, limit_bytes), min(available, max(0, limit_bytes - used))
    return total, available


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def plan_memory(
    config: EngineConfig,
    *,
    n_experts: int,
    slot_bytes: int,
    min_slots: int,
    held_bytes: int,
    scratch_bytes: int,
    free_bytes: int,
    total_bytes: int,
) -> MemoryPlan:
    """Cache slots and KV budget for ``config`` on a model whose experts take
    ``slot_bytes`` each. ``held_bytes``: what the process holds already (runtime, dense
    weights); ``scratch_bytes``: what running requests may take besides KV (activations);
    ``free_bytes``/``total_bytes``: the memory the OS has free now and in all.

    An explicit ``cache`` is taken as given (KV: ``kv_budget_mib`` or 2 GiB). A
    ``memory`` total, or with "auto" what is free less a headroom, is shared: the held
    part and the scratch first, then the KV (its own budget if given, else a quarter of
    what is left, between 64 MiB and 2 GiB) and the cache the rest, every expert if
    they fit; KV then takes what the cache leaves, up to its cap. There the KV room
    no request holds may lend the cache slots (``MemoryPlan.shared``)."""
    kv_cap = (config.kv_budget_mib << 20) if config.kv_budget_mib else _KV_DEFAULT
    if config.cache != AUTO:
        slots = min(parse_cache_size(config.cache, n_experts, slot_bytes), n_experts)
        return MemoryPlan(slots, kv_cap, 0, f"cache {config.cache}: {_gib(slots * slot_bytes)}")
    if config.memory:
        total = parse_size(config.memory, total_bytes)
        why = f"the {_gib(total)} memory budget"
    else:
        headroom = max(_HEADROOM_MIN, total_bytes // 10)
        total = held_bytes + max(0, free_bytes - headroom)
        why = f"{_gib(free_bytes)} free, leaving {_gib(headroom)}"
    room = total - held_bytes - scratch_bytes
    kv = kv_cap if config.kv_budget_mib else min(kv_cap, max(_KV_MIN, room // 4))
    slots = min(n_experts, max(0, room - kv) // slot_bytes)
    if slots < min_slots:
        need = held_bytes + scratch_bytes + kv + min_slots * slot_bytes
        if config.memory:
            raise ValueError(
                f"a memory budget of {_gib(total)} leaves no room for {min_slots} experts "
                f"(one token's) after the {_gib(held_bytes)} already held (runtime, dense "
                f"weights), {_gib(scratch_bytes)} of scratch and {_gib(kv)} of KV; "
                f"it needs at least {_gib(need)}"
            )
        slots = min_slots
        return MemoryPlan(
            slots,
            kv,
            need,
            f"memory is short ({why}; KV {_gib(kv)}): the smallest cache, {slots} "
            "experts; close other programs or give --memory for more",
            shared=True,
        )
    if not config.kv_budget_mib:
        kv = min(kv_cap, room - slots * slot_bytes)
    share = (
        "every expert" if slots == n_experts else f"{100 * slots / n_experts:.0f} % of the experts"
    )
    note = f"cache auto: {share}, {_gib(slots * slot_bytes)} ({why})"
    return MemoryPlan(slots, kv, total, note, shared=True)


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1") != "0"


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model. Validated here; model-dependent limits in the engine."""

    device: str = "cpu"
    storage: str = (
        "ssd"  # "ssd": experts read from the model file with O_DIRECT; "host": all in RAM
    )
    # Fraction, percentage, count or size (see parse_cache_size), or "auto": every expert
    # where they fit in the memory free now (or in ``memory``), else what fits.
    cache: str = AUTO
    # A total for everything the engine's process holds (runtime, dense weights, cache,
    # KV, scratch): "4GiB" or "60%" of the RAM; "" for none. With it the cache is "auto".
    memory: str = ""
    # "lfu", "lru" or "reuse" (see backend/engine/cache.py). "reuse" fetches fewer experts,
    # but its bookkeeping runs on the engine thread between jobs, so it pays only where a
    # fetch is long against that Python (docs/performance.md has both measured).
    eviction: str = "lfu"
    policy: str = "bevy"
    max_active: int = 16  # requests running at once; more wait in the admission queue
    # The link reads experts into the cache from the start, a few at a time behind any
    # request's own reads, so that a first use waits on the disk as little as the budget
    # allows (llama.cpp's warm-up touches every expert too): every expert where each has
    # a slot, else as many as the free slots take, the same share of each layer.
    warm: bool = True
    # KV bytes admission keeps running requests within; None: planned (``plan_memory``).
    kv_budget_mib: int | None = None
    # How the KV cache stores keys and values: "auto" (as the activations: float32 on the
    # CPU), "f16" (llama.cpp's default: half the bytes a context holds; decoding at long
    # contexts reads them all every layer, so it runs faster too) or "f32". With "f16"
    # results are those of float16 keys and values, the same under every policy.
    kv_type: str = "auto"
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
    # prefetch-*, bevy-static) never slice. On the CPU a multiple of 512 keeps each
    # prompt's bits those of one whole job (``JobRunner.run_rows``).
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
    # Bytes a second of a paced link (0: none): the experts' reads land no sooner than a
    # link of this speed would carry them, one after another, so that policies can be
    # compared on a link of one steady speed where the disk's own swings (``bevy bench
    # --link-rate``; the C link loop only).
    link_rate: int = 0

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
        if self.kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {self.kv_type!r}")
        if self.kv_budget_mib is not None and self.kv_budget_mib < 1:
            raise ValueError(f"kv_budget_mib must be >= 1, got {self.kv_budget_mib}")
        cache = str(self.cache).strip()
        object.__setattr__(self, "cache", AUTO if cache.lower() == AUTO else cache)
        object.__setattr__(self, "memory", str(self.memory).strip())
        if self.cache != AUTO:
            parse_cache_size(self.cache, 1000, 1)  # the format; the engine applies limits
        if self.memory:
            if self.cache != AUTO:
                raise ValueError("give a cache size or a memory budget, not both")
            parse_size(self.memory, 1)
        policy_fields(self.policy)  # raises ValueError naming the known policies
