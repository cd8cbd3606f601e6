"""App settings: defaults, validation and conversion to engine/sampling configs (no Qt).

Plain data and functions, so the window, the controller, the dialogs and the tests share
one definition of a valid setting and of how it becomes an engine or sampling config.
"""

from __future__ import annotations

from backend.api import EngineConfig, SamplingParams

DEFAULTS: dict = {
    "model": "",  # empty: the demo MoE
    "device": "auto",
    "storage": "ssd",
    # Every expert where they fit in the memory free at load, else what fits.
    "cache": "auto",
    # A total for the engine (runtime, dense weights, cache, KV): "" none, "4GiB", "60%".
    "memory": "",
    "policy": "bevy",
    "max_active": 8,
    "temperature": 0.7,
    "top_p": 0.95,
    "max_tokens": 512,
    # A chat that outgrows the context drops its oldest turns (the system prompt stays),
    # as LM Studio's default; a session can choose otherwise (Session settings).
    "context_overflow": "rolling",
    "api_enabled": False,
    "api_port": 8080,
    "api_key": "",
}
ENGINE_KEYS = ("model", "device", "storage", "cache", "memory", "policy", "max_active")
DEVICES = ("auto", "cuda", "mps", "cpu")
STORAGES = ("ssd", "host")
POLICIES = ("bevy", "sync", "prefetch-gate", "prefetch-history")
OVERFLOWS = ("rolling", "truncate_middle", "error")
# What is kept per model, as LM Studio keeps a model's load settings: chosen in Settings
# with that model selected, and applied whenever that model is loaded again.
MODEL_KEYS = ("storage", "cache", "policy", "context_overflow")
PROFILES_KEY = "model_profiles"  # the store setting: model path ("" demo) -> its values


def profile(s: dict) -> dict:
    """The per-model part of settings ``s``."""
    return {k: s[k] for k in MODEL_KEYS}


def with_profile(s: dict, model: str, profiles: dict | None) -> dict:
    """Settings ``s`` for ``model``: its remembered values over them, if it has any."""
    own = (profiles or {}).get(model) or {}
    return {**s, "model": model, **{k: own[k] for k in MODEL_KEYS if k in own}}


def merged(saved: dict | None) -> dict:
    """Saved settings over the defaults; unknown keys dropped. Settings saved before the
    memory limit existed hold the old default cache, 30 %, for every user who saved any
    setting: those get auto, the new default."""
    out = {k: (saved or {}).get(k, v) for k, v in DEFAULTS.items()}
    if saved and "memory" not in saved and str(saved.get("cache")) == "30%":
        out["cache"] = DEFAULTS["cache"]
    return out


def engine_config(s: dict) -> EngineConfig:
    """Raises ValueError naming the bad field."""
    if s.get("context_overflow", "rolling") not in OVERFLOWS:
        raise ValueError(f"context_overflow must be one of {', '.join(OVERFLOWS)}")
    memory = str(s["memory"]).strip()
    return EngineConfig(
        device=s["device"],
        storage=s["storage"],
        # The memory limit is the app's, the cache size each model's: with a limit, the
        # cache is what it leaves, whatever a model's own settings say.
        cache="auto" if memory else str(s["cache"]),
        memory=memory,
        policy=s["policy"],
        max_active=int(s["max_active"]),
    )


def sampling(s: dict, session: dict | None = None) -> SamplingParams:
    """Defaults from the settings, overridden by a session's own sampling values."""
    values = {k: s[k] for k in ("temperature", "top_p", "max_tokens")}
    values.update((session or {}).get("sampling") or {})
    return SamplingParams(
        temperature=float(values["temperature"]),
        top_p=float(values["top_p"]),
        max_tokens=int(values["max_tokens"]),
    )
