"""Expert-cache replay: how often would a cache of N slots hold the expert a token needs?

Used to calibrate the demo MoE's router skew and to report hit rates for traces.
LFU counts every use since the start (evicting the least used resident entry, oldest
use first on ties); LRU evicts the least recently used.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable


def lfu_hit_rate(uses: Iterable[Hashable], capacity: int) -> float:
    if capacity <= 0:
        return 0.0
    counts: dict[Hashable, int] = {}
    resident: dict[Hashable, tuple[int, int]] = {}  # key -> (count, tick) of its live heap entry
    heap: list[tuple[int, int, Hashable]] = []
    hits = total = 0
    for tick, key in enumerate(uses):
        total += 1
        counts[key] = counts.get(key, 0) + 1
        if key in resident:
            hits += 1
        elif len(resident) >= capacity:
            while True:  # lazy deletion: skip heap entries that are no longer current
                c, t, victim = heapq.heappop(heap)
                if resident.get(victim) == (c, t):
                    del resident[victim]
                    break
        resident[key] = (counts[key], tick)
        heapq.heappush(heap, (counts[key], tick, key))
    return hits / total if total else 0.0


def lru_hit_rate(uses: Iterable[Hashable], capacity: int) -> float:
    cache: OrderedDict[Hashable, None] = OrderedDict()
    hits = total = 0
    for key in uses:
        total += 1
        if key in cache:
            hits += 1
            cache.move_to_end(key)
            continue
        if capacity > 0:
            if len(cache) >= capacity:
                cache.popitem(last=False)
            cache[key] = None
    return hits / total if total else 0.0
