"""Expert cache bookkeeping: which (layer, expert) sits in which device slot.

Pure Python (no torch): the engine owns the slot tensor; this decides placement.
- An entry is *loading* from reservation until its fetch completes, then *ready*.
- ``pin``/``unpin`` count references held by jobs; only ready entries with zero
  references are evictable, so an expert a job relies on is never replaced under it.
- A key that is loading is never fetched twice (pending fetches are deduplicated).
- Eviction, among evictable entries only: LRU (least recently used), LFU (fewest uses
  since start, oldest use first on ties), or ``reuse``: the entry whose next use is
  expected latest, from how often it is used and where the running requests are in the
  cycle of layers (``set_positions``; see ``_reuse_time``). Every token walks the
  layers in order, so an expert of the layer all requests just left is needed again
  only at the next token, while one of the layer a request is about to reach may be
  needed at once: frequency alone cannot tell these apart, and both LRU and LFU evict
  into a cyclic walk that is larger than the cache.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.policies import EVICTION_POLICIES

if TYPE_CHECKING:
    from backend.engine.request import Request

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
    """``n_slots`` entries, in as many slots, and ``spare`` slots more that ``resize`` may
    lend it while the memory is not wanted elsewhere (KV room no request holds)."""

    def __init__(self, n_slots: int, policy: str = "lru", spare: int = 0) -> None:
        if n_slots < 1:
            raise ValueError(f"the expert cache needs at least one slot, got {n_slots}")
        if policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction policy must be one of {', '.join(EVICTION_POLICIES)}, got {policy!r}"
            )
        self.n_slots = n_slots  # entries it may hold now (``resize``)
        self.n_alloc = n = n_slots + spare  # slots the owner allocated
        self.policy = policy
        self.slot_of: dict[Key, int] = {}
        self.key_of: list[Key | None] = [None] * n
        self.refs = [0] * n
        self.ready = [False] * n
        self.generation = [0] * n  # bumped whenever a slot gets new contents
        self.free = list(range(n - 1, -1, -1))  # last out first: a refilled slot is reused
        self._filled = [False] * n  # free slots whose memory still holds an old fill
        self.stats = CacheStats()
        self._uses: dict[Key, int] = {}
        self._tick = 0
        self._last: dict[Key, int] = {}
        self._lru: OrderedDict[Key, None] = OrderedDict()  # evictable keys, oldest first
        self._heap: list[tuple[int, int, Key]] = []  # LFU: (uses, last use, key), lazily pruned
        # reuse: the same entries in one heap per layer, and what ``_reuse_time`` needs.
        self._layer_heaps: dict[int, list[tuple[int, int, Key]]] = {}
        self._n_layer_heaped = 0
        self._passes: dict[int, int] = {}  # jobs routed at each layer (``record_pass``)
        self._positions: tuple[int, ...] = ()  # layers the running requests are at, sorted
        self._count: Counter[int] = Counter()  # requests at each of those layers
        self._at: list[int] = []  # those layers, sorted
        self._dists: dict[int, list[tuple[int, int]]] = {}  # per layer: (steps away, requests)
        self._n_layers = 0
        self._wanted: frozenset[Key] = frozenset()
        self._reuse_memo: dict[tuple[int, int, int], float] = {}
        self._held: list[tuple[int, int, Key]] = []  # wanted entries out of their heaps
        self._ranks: list[tuple[float, int, int, int]] | None = None  # see _reuse_victim
        self.guessed: set[Key] = set()  # prefetched entries no job has claimed yet
        self.n_loading = 0  # entries reserved whose fetch has not completed
        # Told when an entry becomes ready in its slot, and when a ready or loading entry
        # leaves its slot (evicted, cancelled): the native decode walk's expert table.
        self.on_ready: Callable[[Key, int], None] | None = None
        self.on_gone: Callable[[Key], None] | None = None

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
        return max(0, self.n_slots - len(self.slot_of)) + len(self._lru)

    def n_evictable(self, keys: list[Key]) -> int:
        """How many of ``keys`` are cached, unpinned and ready (so would be pinned by a claim)."""
        return sum(1 for k in keys if k in self._lru)

    # --- uses, pins ---------------------------------------------------------------------

    def uses(self, key: Key) -> int:
        """Jobs that have routed to ``key`` since start (``record_use``)."""
        return self._uses.get(key, 0)

    def record_use(self, key: Key) -> None:
        """Count one use of ``key`` (a job routed to it): the eviction order's input."""
        self._tick += 1
        self._uses[key] = self._uses.get(key, 0) + 1
        self._last[key] = self._tick
        if key in self.slot_of:
            self._touch(key)

    def record_pass(self, layer: int) -> None:
        """A job routed at ``layer`` (its uses follow as ``record_use``): how often an
        expert is used per pass is its uses over its layer's passes."""
        self._passes[layer] = self._passes.get(layer, 0) + 1
        self._ranks = None  # a use rate changed: ranks may get better, not only worse

    def set_positions(
        self, layers: Sequence[int], n_layers: int, wanted: frozenset[Key] = frozenset()
    ) -> None:
        """For ``reuse``: the layer each running request is at (its next job runs that
        layer's experts, then reaches the next layer), and ``wanted``, experts requests
        have routed to but not claimed yet (evicted last)."""
        if layers and n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        positions = tuple(sorted(layers))
        if positions == self._positions and n_layers == self._n_layers:
            # The engine sets these before every claim; most claims follow a fetch landing,
            # which moves nobody: the distances and ranks stand. Entries no longer wanted
            # go back to their heaps (and their layers' ranks are pushed anew).
            self._wanted = wanted
            kept = [e for e in self._held if e[2] in wanted]
            if len(kept) < len(self._held):
                back = [e for e in self._held if e[2] not in wanted]
                self._held = kept
                self._unhold(back)
            return
        self._n_layers, self._wanted, self._positions = n_layers, wanted, positions
        self._count = Counter(positions)
        self._at = sorted(self._count)
        self._dists.clear()
        self._reuse_memo.clear()
        held, self._held, self._ranks = self._held, [], None
        self._unhold(held)

    def _unhold(self, entries: list[tuple[int, int, Key]]) -> None:
        for entry in entries:
            heapq.heappush(self._layer_heaps[entry[2][0]], entry)
        self._n_layer_heaped += len(entries)
        if self._ranks is not None:
            for layer in {e[2][0] for e in entries}:
                if (rank := self._layer_rank(layer)) is not None:
                    heapq.heappush(self._ranks, rank)

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
        if len(self.slot_of) < self.n_slots:
            slot = self.free.pop()
        else:
            slot = self._evict()
            if slot is None:
                return None
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.generation[slot] += 1
        self.ready[slot] = False
        self.refs[slot] = 1
        self._filled[slot] = True
        self.stats.fetches += 1
        self.n_loading += 1
        return slot

    def _evict(self) -> int | None:
        """Take the eviction order's first entry out; its slot, or None if none can go."""
        victim = self._victim()
        if victim is None:
            return None
        slot = self.slot_of.pop(victim)
        self.key_of[slot] = None
        self.stats.evictions += 1
        if self.on_gone is not None:
            self.on_gone(victim)
        if victim in self.guessed:
            self.guessed.discard(victim)
            self.stats.prefetch_wasted += 1
        return slot

    def resize(self, n: int) -> list[int] | None:
        """Hold at most ``n`` entries from now (within the slots allocated). Shrinking
        evicts in the eviction order; None, changing nothing, where more than ``n`` are
        pinned or loading. Returns the free slots whose memory still holds an old fill,
        for the owner to give back to the system: the slots that hold anything are then
        no more than the cache's entries."""
        n = min(n, self.n_alloc)
        if n < 1 or len(self.slot_of) - len(self._lru) > n:
            return None
        while len(self.slot_of) > n:
            slot = self._evict()
            assert slot is not None  # enough are evictable: checked above
            self.ready[slot] = False
            self.free.append(slot)
        self.n_slots = n
        released = [s for s in self.free if self._filled[s]]
        for s in released:
            self._filled[s] = False
        return released

    def mark_prefetched(self, key: Key) -> None:
        """``key`` was just reserved on a guess: track whether a job ever claims it."""
        self.guessed.add(key)
        self.stats.prefetched += 1

    def complete(self, key: Key) -> None:
        slot = self.slot_of[key]
        self.ready[slot] = True
        self.n_loading -= 1
        if self.on_ready is not None:
            self.on_ready(key, slot)
        if self.refs[slot] == 0:
            self._make_evictable(key)

    def cancel(self, key: Key) -> None:
        """A fetch that will not complete (abort before start, I/O error): free its slot."""
        slot = self.slot_of.pop(key)
        self._lru.pop(key, None)
        if not self.ready[slot]:
            self.n_loading -= 1
        if self.on_gone is not None:
            self.on_gone(key)
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
            self._push(key)

    def _make_evictable(self, key: Key) -> None:
        self._lru[key] = None
        self._lru.move_to_end(key)
        self._push(key)

    def _push(self, key: Key) -> None:
        entry = self._entry(key)
        if self.policy == "lfu":
            heapq.heappush(self._heap, entry)
            if len(self._heap) > 2 * len(self._lru) + 64:
                self._rebuild_heap()
        elif self.policy == "reuse":
            heapq.heappush(self._layer_heaps.setdefault(key[0], []), entry)
            self._n_layer_heaped += 1
            if self._ranks is not None:
                if len(self._ranks) > 2 * len(self._layer_heaps) + 64:
                    self._ranks = None  # mostly stale: rebuilt at the next eviction
                elif (rank := self._layer_rank(key[0])) is not None:
                    heapq.heappush(self._ranks, rank)  # the layer's candidate may be this one
            if self._n_layer_heaped > 2 * len(self._lru) + 64:
                self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """Drop stale entries (uses recorded since, keys pinned again) so the heap stays small."""
        entries = [self._entry(k) for k in self._lru]
        if self.policy == "reuse":
            self._layer_heaps = {}
            for e in entries:
                self._layer_heaps.setdefault(e[2][0], []).append(e)
            for h in self._layer_heaps.values():
                heapq.heapify(h)
            self._n_layer_heaped = len(entries)
            self._held, self._ranks = [], None
        else:
            self._heap = entries
            heapq.heapify(self._heap)

    def _entry(self, key: Key) -> tuple[int, int, Key]:
        """``key``'s place in the LFU order: (uses, last use, key), least first."""
        return (self._uses.get(key, 0), self._last.get(key, 0), key)

    def _valid(self, entry: tuple[int, int, Key]) -> bool:
        """A heap entry still stands: its key is evictable and has had no use since."""
        return entry[2] in self._lru and entry == self._entry(entry[2])

    def _reuse_time(self, layer: int, uses: int) -> float:
        """Expected layer steps until some running request next uses an expert of
        ``layer`` with ``uses`` uses (a step: one of a request's own jobs; requests are
        taken to step at the same pace). Each request passes the layer once per token,
        the next time after d steps (``set_positions``), and uses the expert on a pass
        with chance q = uses / passes of the layer, independently. With c_j requests d_j
        steps away (d_1 < d_2 < ...), the first use comes at d_j with chance
        m_j (1 - (1 - q)^c_j), where m_j = (1 - q)^(c_1 + ... + c_(j-1)), or in none of
        this walk's passes, m = (1 - q)^N, and then the same again a walk (L steps) later:
        T = (sum_j d_j m_j (1 - (1 - q)^c_j) + m L) / (1 - m)."""
        passes = self._passes.get(layer, 0)
        memo = (layer, uses, passes)
        t = self._reuse_memo.get(memo)
        if t is not None:
            return t
        L = self._n_layers
        groups = self._dists.get(layer)
        if groups is None:
            # A request at p reaches this layer after layer - p jobs if it is ahead of it,
            # else after the rest of this token's walk (at p itself it has routed: the
            # next token, L jobs). Closest first: those below, then above, then at it.
            i = bisect.bisect_left(self._at, layer)
            order = [*reversed(self._at[:i]), *reversed(self._at[i:])]  # at `layer`: last
            groups = self._dists[layer] = [((layer - p) % L or L, self._count[p]) for p in order]
        q = min(1.0, uses / passes) if passes else 1.0
        if q <= 0.0:
            t = float("inf")
        else:
            acc, m = 0.0, 1.0
            for d, c in groups:
                u = (1.0 - q) ** c
                acc += d * m * (1.0 - u)
                m *= u
            t = (acc + m * L) / (1.0 - m) if m < 1.0 else float("inf")
        self._reuse_memo[memo] = t
        return t

    def _layer_rank(self, layer: int) -> tuple[float, int, int, int] | None:
        """The eviction rank of ``layer``'s candidate, its least used evictable entry no
        request wants (smaller goes first); None if it has none. Wanted entries met on
        the way wait in ``_held`` until the positions change."""
        heap = self._layer_heaps[layer]
        while heap:
            entry = heap[0]
            if not self._valid(entry):
                heapq.heappop(heap)
                self._n_layer_heaped -= 1
            elif entry[2] in self._wanted:
                self._held.append(heapq.heappop(heap))
                self._n_layer_heaped -= 1
            else:
                uses, last, _ = entry
                t = self._reuse_time(layer, uses) if self._positions else 0.0
                return (-t, uses, last, layer)
        return None

    def _reuse_victim(self) -> Key:
        """Of the layers' candidates, the one whose next use is expected latest (ties: the
        less used, then the older use); an entry some request wants only when nothing
        else is left. The layers' ranks are kept in a heap until the positions or a use
        rate change: meanwhile a layer's rank only gets worse as its entries go (claims
        pin them, fetches evict them), and a stale rank is fixed when met; an entry that
        becomes evictable (``_push``) or stops being wanted (``_unhold``) pushes its
        layer's rank anew."""
        if self._ranks is None:
            self._ranks = [r for l in self._layer_heaps if (r := self._layer_rank(l)) is not None]
            heapq.heapify(self._ranks)
        while self._ranks:
            rank = heapq.heappop(self._ranks)
            layer = rank[3]
            current = self._layer_rank(layer)
            if current is None:
                continue
            if current != rank:
                heapq.heappush(self._ranks, current)
                continue
            key = heapq.heappop(self._layer_heaps[layer])[2]
            self._n_layer_heaped -= 1
            following = self._layer_rank(layer)
            if following is not None:
                heapq.heappush(self._ranks, following)
            del self._lru[key]
            return key
        # No layer has an unwanted candidate: the least used evictable entry.
        key = min(self._entry(k) for k in self._lru)[2]
        del self._lru[key]
        return key

    def _victim(self) -> Key | None:
        if not self._lru:
            return None
        if self.policy == "lru":
            key, _ = self._lru.popitem(last=False)
            return key
        if self.policy == "reuse":
            return self._reuse_victim()
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._valid(entry):
                del self._lru[entry[2]]
                return entry[2]
        # Heap entries went stale faster than they were pushed: rebuild from the evictable set.
        self._rebuild_heap()
        return self._victim()


class Claims:
    """Requests' holds on cache entries: the only code that pins, reserves and releases
    experts for jobs (a prefetcher's guess holds no pin).

    A job claims the experts it needs next all at once or not at all (``claim``), so two
    jobs never wait on each other's pins; the claim then shrinks as experts are applied
    (``release``). The request records what it holds (``Request.claim``, and ``claimed``:
    set by a claim, even of no experts, as a dense layer's job is; cleared when a release
    leaves nothing); only this class changes either.
    """

    def __init__(self, cache: ExpertCache) -> None:
        self.cache = cache

    def claim(self, r: Request, keys: list[Key]) -> list[tuple[Key, int]] | None:
        """Pin ``keys`` for ``r``: the resident ones as they are, a reserved slot for each
        missing one. Returns the fetches to order, (key, slot) each; None, holding
        nothing, if the cache cannot give the missing ones slots now."""
        cache = self.cache
        present = [k for k in keys if cache.is_present(k)]
        absent = [k for k in keys if not cache.is_present(k)]
        # Slots for the missing experts must come from outside the ones this job keeps.
        if len(absent) > cache.n_reservable - cache.n_evictable(present):
            return None
        # Pin what is there first, so reserving slots for the rest cannot evict it.
        for k in present:
            cache.pin(k)
        for k in keys:
            cache.record_lookup(k)  # before reserving: a hit iff ready or loading
        orders = [(k, cache.reserve(k)) for k in absent]
        r.claim, r.claimed = list(keys), True
        return orders

    def release(self, r: Request, experts: Collection[int] | None = None) -> None:
        """Unpin ``r``'s claimed experts that are in ``experts`` (all when None)."""
        kept = []
        for k in r.claim:
            if experts is None or k[1] in experts:
                self.cache.unpin(k)
            else:
                kept.append(k)
        r.claim, r.claimed = kept, bool(kept)

    def guess(self, key: Key) -> int | None:
        """A slot for a prefetch of the absent ``key``, holding no pin, so any claim may
        evict it before a job needs it; None when every slot is pinned."""
        slot = self.cache.reserve(key)
        if slot is not None:
            self.cache.unpin(key)
            self.cache.mark_prefetched(key)
        return slot

    def ride(self, keys: Iterable[Key]) -> None:
        """An unclaimed request used ``keys`` that another job pinned: its claim, when it
        comes, skips them, so they count as the hits they were."""
        for k in keys:
            self.cache.record_lookup(k)

    def cancel(self, key: Key, holders: Iterable[Request]) -> list[Request]:
        """A fetch that will not complete: its slot is freed, with the pins on it. Returns
        the requests among ``holders`` that held one (they cannot go on)."""
        self.cache.cancel(key)
        lost = []
        for r in holders:
            if key in r.claim:
                r.claim.remove(key)
                r.claimed = bool(r.claim)
                lost.append(r)
        return lost
