"""Expert cache bookkeeping: which (layer, expert) sits in which device slot.

Pure Python (no torch): the engine owns the slot tensor; this decides placement.
- An entry is *loading* from reservation until its fetch completes, then *ready*.
- ``pin``/``unpin`` count references held by jobs; only ready entries with zero
  references are evictable, so an expert a job relies on is never replaced under it.
- A key that is loading is never fetched twice (pending fetches are deduplicated).
- Eviction: LRU (least recently used) or LFU (fewest uses since start, oldest use first
  on ties), among evictable entries only.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

Key = tuple[int, int]  # (layer, expert)


@dataclass
class CacheStats:
    hits: int = 0  # claimed experts that were ready or already loading
    misses: int = 0  # claimed experts that had to be fetched
    fetches: int = 0
    evictions: int = 0
    prefetched: int = 0  # slots filled on a guess
    prefetch_used: int = 0  # ... later claimed by a job
    prefetch_wasted: int = 0  # ... evicted or cancelled before any job claimed them

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ExpertCache:
    def __init__(self, n_slots: int, policy: str = "lru") -> None:
        if n_slots < 1:
            raise ValueError(f"the expert cache needs at least one slot, got {n_slots}")
        if policy not in ("lru", "lfu"):
            raise ValueError(f"eviction policy must be 'lru' or 'lfu', got {policy!r}")
        self.n_slots = n_slots
        self.policy = policy
        self.slot_of: dict[Key, int] = {}
        self.key_of: list[Key | None] = [None] * n_slots
        self.refs = [0] * n_slots
        self.ready = [False] * n_slots
        self.generation = [0] * n_slots  # bumped whenever a slot gets new contents
        self.free = list(range(n_slots - 1, -1, -1))
        self.stats = CacheStats()
        self._uses: dict[Key, int] = {}
        self._tick = 0
        self._last: dict[Key, int] = {}
        self._lru: OrderedDict[Key, None] = OrderedDict()  # evictable keys, oldest first
        self._heap: list[tuple[int, int, Key]] = []  # LFU: (uses, last use, key), lazily pruned
        self.guessed: set[Key] = set()  # prefetched entries no job has claimed yet

    # --- queries ------------------------------------------------------------------------

    def is_ready(self, key: Key) -> bool:
        slot = self.slot_of.get(key)
        return slot is not None and self.ready[slot]

    def is_present(self, key: Key) -> bool:
        """Ready or loading."""
        return key in self.slot_of

    @property
    def n_pinned(self) -> int:
        return sum(1 for r in self.refs if r > 0)

    @property
    def n_used(self) -> int:
        return len(self.slot_of)

    @property
    def n_reservable(self) -> int:
        """Slots a new fetch could take now (free or evictable)."""
        return len(self.free) + len(self._lru)

    def n_evictable(self, keys: list[Key]) -> int:
        """How many of ``keys`` are cached, unpinned and ready (so would be pinned by a claim)."""
        return sum(1 for k in keys if k in self._lru)

    # --- uses, pins ---------------------------------------------------------------------

    def record_use(self, key: Key) -> None:
        """Count one use of ``key`` (a job routed to it): the LFU/LRU order."""
        self._tick += 1
        self._uses[key] = self._uses.get(key, 0) + 1
        self._last[key] = self._tick
        if key in self.slot_of:
            self._touch(key)

    def record_lookup(self, key: Key) -> bool:
        """A job claims ``key``: a hit if ready or already loading, else a miss."""
        hit = key in self.slot_of
        if key in self.guessed:
            self.guessed.discard(key)
            self.stats.prefetch_used += 1
        if hit:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
        return hit

    def pin(self, key: Key) -> int:
        slot = self.slot_of[key]
        if self.refs[slot] == 0:
            self._lru.pop(key, None)
        self.refs[slot] += 1
        return slot

    def unpin(self, key: Key) -> None:
        slot = self.slot_of[key]
        if self.refs[slot] <= 0:
            raise RuntimeError(f"unpin of {key} with no pins")
        self.refs[slot] -= 1
        if self.refs[slot] == 0 and self.ready[slot]:
            self._make_evictable(key)

    # --- fetch lifecycle ----------------------------------------------------------------

    def reserve(self, key: Key) -> int | None:
        """Give an absent ``key`` a slot (evicting if needed) and pin it; None if all are pinned."""
        if key in self.slot_of:
            raise RuntimeError(f"{key} is already cached or loading")
        if self.free:
            slot = self.free.pop()
        else:
            victim = self._victim()
            if victim is None:
                return None
            slot = self.slot_of.pop(victim)
            self.stats.evictions += 1
            if victim in self.guessed:
                self.guessed.discard(victim)
                self.stats.prefetch_wasted += 1
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.generation[slot] += 1
        self.ready[slot] = False
        self.refs[slot] = 1
        self.stats.fetches += 1
        return slot

    def mark_prefetched(self, key: Key) -> None:
        """``key`` was just reserved on a guess: track whether a job ever claims it."""
        self.guessed.add(key)
        self.stats.prefetched += 1

    def complete(self, key: Key) -> None:
        slot = self.slot_of[key]
        self.ready[slot] = True
        if self.refs[slot] == 0:
            self._make_evictable(key)

    def cancel(self, key: Key) -> None:
        """A fetch that will not complete (abort before start, I/O error): free its slot."""
        slot = self.slot_of.pop(key)
        self._lru.pop(key, None)
        if key in self.guessed:
            self.guessed.discard(key)
            self.stats.prefetch_wasted += 1
        self.key_of[slot] = None
        self.ready[slot] = False
        self.refs[slot] = 0
        self.free.append(slot)

    # --- eviction order -----------------------------------------------------------------

    def _touch(self, key: Key) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)
            if self.policy == "lfu":
                heapq.heappush(self._heap, (self._uses.get(key, 0), self._last.get(key, 0), key))
                if len(self._heap) > 2 * len(self._lru) + 64:
                    self._rebuild_heap()

    def _make_evictable(self, key: Key) -> None:
        self._lru[key] = None
        self._lru.move_to_end(key)
        if self.policy == "lfu":
            heapq.heappush(self._heap, (self._uses.get(key, 0), self._last.get(key, 0), key))
            if len(self._heap) > 2 * len(self._lru) + 64:
                self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """Drop stale entries (uses recorded since, keys pinned again) so the heap stays small."""
        self._heap = [(self._uses.get(k, 0), self._last.get(k, 0), k) for k in self._lru]
        heapq.heapify(self._heap)

    def _victim(self) -> Key | None:
        if not self._lru:
            return None
        if self.policy == "lru":
            key, _ = self._lru.popitem(last=False)
            return key
        while self._heap:
            uses, last, key = heapq.heappop(self._heap)
            current = (self._uses.get(key, 0), self._last.get(key, 0))
            if key in self._lru and (uses, last) == current:
                del self._lru[key]
                return key
        # Heap entries went stale faster than they were pushed: rebuild from the evictable set.
        self._rebuild_heap()
        return self._victim()
