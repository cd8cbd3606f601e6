"""The names a user can pick: scheduling policies, cache evictions, KV cache types.

Plain tables without imports, so configs validate a name, and the app lists them,
without loading the engine. ``backend.engine.scheduler`` builds a ``Policy`` from them.
"""

from __future__ import annotations

EVICTION_POLICIES = ("lru", "lfu", "reuse")  # see backend/engine/cache.py
# "auto" or one of backend/engine/experts/ (chosen once at start; see there).
EXPERT_BACKENDS = ("auto", "native", "compiled", "grouped", "eager")
# How the KV cache stores keys and values (``Transformer.set_kv_type``).
KV_TYPES = ("auto", "f16", "f32")

POLICIES = (
    "bevy",
    "sync",
    "prefetch-gate",
    "prefetch-history",
    "bevy-static:K",
    "bevy-fifo",
    "bevy-srtf",
    "bevy+prefetch-gate",
    "bevy-nosplit",
    "bevy-nobalance",
)

# One line each, for the app's compare view and `bevy bench --help`-style listings.
POLICY_NOTES = {
    "bevy": "Runahead: ready requests compute layer by layer while the link fetches only experts some request has already selected; held together while compute is the bottleneck.",
    "sync": "llama.cpp-like: all requests advance together; each layer waits for its missing experts to load.",
    "prefetch-gate": "Applies the next layer's router to this layer's hidden state and loads the guessed experts while the link is idle.",
    "prefetch-history": "Guesses the next layer's experts from recorded layer-to-layer co-activation and loads them ahead.",
    "bevy-static:K": "Ablation: runahead in fixed groups of K requests instead of self-balancing groups.",
    "bevy-fifo": "Ablation: runahead computing jobs in arrival order instead of lowest layer first.",
    "bevy-srtf": "Ablation: runahead fetching for the job with the fewest missing experts first, globally.",
    "bevy+prefetch-gate": "Runahead plus gate prefetching on the idle link.",
    "bevy-nosplit": "Ablation: runahead where a waiting job never applies its cached experts early.",
    "bevy-nobalance": "Ablation: runahead even while compute is the bottleneck and the link idles (bevy then holds requests together).",
}


def policy_fields(name: str) -> dict[str, object]:
    """``scheduler.Policy``'s fields for the policy ``name``; ValueError if unknown."""
    if name == "bevy":
        return dict(balance=True)
    if name == "bevy-nobalance":
        return {}
    if name == "sync":
        return dict(lockstep=True, ride=False, split=False)
    if name in ("prefetch-gate", "prefetch-history"):
        return dict(lockstep=True, prefetch=name.split("-")[1], ride=False, split=False)
    if name == "bevy-fifo":
        return dict(compute_order="fifo")
    if name == "bevy-srtf":
        return dict(fetch_order="srtf")
    if name == "bevy+prefetch-gate":
        return dict(prefetch="gate")
    if name == "bevy-nosplit":
        return dict(split=False)
    if name.startswith("bevy-static:"):
        try:
            k = int(name.split(":", 1)[1])
        except ValueError:
            k = 0
        if k < 1:
            raise ValueError(
                f"bevy-static needs a positive group size, e.g. bevy-static:4 (got {name!r})"
            )
        return dict(group_size=k, ride=False, split=False)
    raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
