"""Expert-cache replay: how often would a cache of N slots hold the expert a token needs?

Used to calibrate the demo MoE's router skew and to report hit rates for traces. It
drives the engine's own ``ExpertCache``, so replayed and live eviction are the same
code: LFU counts every use since the start (least used first, oldest use first on
ties); LRU evicts the least recently used.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from backend.engine.cache import ExpertCache


def hit_rate(uses: Iterable[Hashable], capacity: int, policy: str) -> float:
    if capacity <= 0:
        return 0.0
    cache = ExpertCache(capacity, policy)
    hits = total = 0
    for key in uses:
        total += 1
        cache.record_use(key)
        if cache.is_present(key):
            hits += 1
            continue
        cache.reserve(key)
        cache.complete(key)
        cache.unpin(key)
    return hits / total if total else 0.0


def lfu_hit_rate(uses: Iterable[Hashable], capacity: int) -> float:
    return hit_rate(uses, capacity, "lfu")


def lru_hit_rate(uses: Iterable[Hashable], capacity: int) -> float:
    return hit_rate(uses, capacity, "lru")
