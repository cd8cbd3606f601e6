"""Scheduling policies: which ready jobs compute together, which blocked jobs fetch first.

Pure Python over ``Request`` state, so every policy is tested without torch work.

- ``bevy``: compute all ready jobs at the lowest ready layer (opportunistic layerwise
  grouping); claim/fetch for the blocked job with the lowest layer first, ties broken by
  fewest missing experts (SRTF). While compute is the bottleneck and the link idles,
  the requests advance together instead (``backend.engine.balance``). Requests at that layer still waiting for other experts
  ride along on the experts they share with the group (``ride``). When no job is ready,
  waiting jobs apply the experts they already have (``split``): decoding jobs any of
  them, short prompts those that come first in expert order. Long prompts read in parts
  go furthest behind first and share each layer's parts (``progress``, ``prompt_part``).
- ``sync``: llama.cpp-like: all running requests advance as one batch, layer by layer;
  experts are fetched on demand and compute waits for them.
- ``prefetch-gate`` / ``prefetch-history``: ``sync`` plus prefetching of predicted
  next-layer experts on the otherwise idle link.
- Ablations: ``bevy-static:K`` (fixed groups of K requests advance together),
  ``bevy-fifo`` (compute the longest-ready job's layer first), ``bevy-srtf`` (fetch by
  fewest missing experts globally, ignoring layers), ``bevy+prefetch-gate``,
  ``bevy-nosplit`` (a waiting job never applies its cached experts early; see ``split``),
  ``bevy-nobalance`` (runahead even when compute is the bottleneck).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.policies import policy_fields

if TYPE_CHECKING:
    from backend.engine.request import Request

Missing = Callable[["Request"], int]  # experts of the request's current job not yet cached


@dataclass(frozen=True)
class Policy:
    name: str
    lockstep: bool = False  # all requests advance together (sync and its prefetch variants)
    group_size: int = 0  # bevy-static:K
    compute_order: str = "layer"  # "layer" (lowest first) or "fifo"
    fetch_order: str = "layer"  # "layer" (lowest layer, then fewest missing) or "srtf"
    prefetch: str | None = None  # None, "gate" or "history"
    # Requests at the group's layer that wait for other experts ride along on the ones
    # the group runs (their rows join the same products; see ``riders``).
    ride: bool = True
    # With no job ready, jobs still waiting for some experts apply the ones already in
    # the cache (see ``split``): the compute lane works while the link loads the rest,
    # and the job has less left to do when they arrive.
    split: bool = True
    # Requests advance together while compute is the bottleneck and the link idles
    # (``backend.engine.balance``): runahead's smaller batches would only cost compute.
    balance: bool = False

    def claim_order(
        self, blocked: Sequence[Request], missing: Missing, low_layer: int = 0
    ) -> list[Request]:
        """Order in which unclaimed jobs get cache slots and fetches. ``low_layer``: the
        lowest layer any running request is at."""
        if self.lockstep:
            # Only the batch's current layer: nobody runs ahead of the slowest request.
            return sorted((r for r in blocked if r.layer == low_layer), key=lambda r: r.arrival)
        if self.fetch_order == "srtf":
            return sorted(blocked, key=lambda r: (missing(r), r.layer, r.arrival))
        return sorted(blocked, key=lambda r: (r.layer, missing(r), r.arrival))

    def fetch_priority(self, r: Request, missing: int, tick: int) -> tuple:
        """Key of a demand fetch in the link's queue (smallest first)."""
        if self.lockstep:
            return (tick, r.arrival)
        if self.fetch_order == "srtf":
            return (missing, r.layer, tick)
        return (r.layer, missing, tick)

    def compute_group(
        self, running: Sequence[Request], ready: Sequence[Request], together: bool = False
    ) -> list[Request]:
        """The requests whose jobs run now as one batch (empty: wait for fetches).
        ``together``: the batch at the lowest layer waits for all of its claimed jobs, as
        lockstep's does (``bevy`` while compute is the bottleneck: ``engine.balance``);
        where none of it can run (its jobs unclaimed: the cache's slots are pinned by jobs
        further on, which runahead claimed), the lowest ready layer runs, releasing them."""
        if not ready:
            return []
        if self.lockstep or together:
            # The batch at its lowest layer moves together once every claimed job is ready.
            # Jobs the cache could not take this round (unclaimed) follow in a later
            # round of the same layer: the safe fallback when the cache is too small.
            low = min(r.layer for r in running)
            batch = [r for r in running if r.layer == low]
            ready_ids = {id(r) for r in ready}
            if any(r.claimed and id(r) not in ready_ids for r in batch):
                return []
            members = [r for r in batch if id(r) in ready_ids]
            if members or self.lockstep:
                return members
        if self.group_size:
            return self._static_group(running, ready)
        if self.compute_order == "fifo":
            first = min(ready, key=lambda r: (r.ready_since, r.arrival))
            layer = first.layer
        else:
            layer = min(r.layer for r in ready)
        return [r for r in ready if r.layer == layer]

    def _groups(self, running: Sequence[Request]) -> list[list[Request]]:
        groups: dict[int, list[Request]] = {}
        for r in sorted(running, key=lambda r: r.arrival):
            groups.setdefault(r.arrival // self.group_size, []).append(r)
        return list(groups.values())

    def _static_group(self, running: Sequence[Request], ready: Sequence[Request]) -> list[Request]:
        """Each fixed group is a small lockstep batch; the group at the lowest layer goes first."""
        ready_ids = {id(r) for r in ready}
        best: list[Request] = []
        for g in self._groups(running):
            low = min(r.layer for r in g)
            batch = [r for r in g if r.layer == low]
            if any(r.claimed and id(r) not in ready_ids for r in batch):
                continue
            members = [r for r in batch if id(r) in ready_ids]
            if members and (not best or low < best[0].layer):
                best = members
        if not best:
            # No group can move: a request that claimed while it was its group's lowest
            # (before a later arrival joined the group behind it) holds pins its group's
            # lowest job may need to claim at all. The lowest ready jobs run, releasing them.
            low = min(r.layer for r in ready)
            best = [r for r in ready if r.layer == low]
        return best

    def static_claimable(self, running: Sequence[Request]) -> set[int]:
        """bevy-static: only jobs at their group's lowest layer may claim."""
        return {
            id(r) for g in self._groups(running) for r in g if r.layer == min(x.layer for x in g)
        }


Ride = tuple["Request", set[int]]  # a request and some of its experts to apply in a run


def riders(running: Sequence[Request], group: Sequence[Request]) -> list[Ride]:
    """Decoding requests at the group's layer that are not in it, each with those of its
    remaining experts the group runs anyway (all pinned and ready for the group): their
    rows join those experts' products, so each expert's bytes are read once for all."""
    layer = group[0].layer
    experts = {e for r in group for _, e in r.claim}
    members = {id(r) for r in group}
    out = []
    for r in running:
        if r.layer != layer or r.n != 1 or id(r) in members:
            continue
        mine = {e for _, e in r.claim} if r.claimed else set(r.needed) - r.done
        subset = mine & experts
        if subset:
            out.append((r, subset))
    return out


def split(
    running: Sequence[Request],
    is_ready: Callable[[tuple[int, int]], bool],
    max_rows: int = 0,
) -> list[Ride]:
    """With no job ready: jobs still waiting for some experts, at the lowest such layer,
    each with its claimed experts that are ready. Applying them now, while the link loads
    the rest, leaves less for the job to do once its last expert arrives.

    A decoding job applies any of its ready experts (it keeps each product apart and sums
    them in expert order at the end). A prompt of at most ``max_rows`` rows (0: none)
    adds its products into its rows as it goes, so it takes only the ready experts that
    come first in expert order among those it has left: the same sums in the same order
    as one whole job (on the CPU backends; the grouped one's batched products round by
    their batch, as a decoding split's do), while its layer's experts are still arriving
    (a longer prompt is read in parts of its own, ``Engine._run_slice``).

    An expert that another request at this layer still needs but cannot apply now is left
    out, to run once for all later (as a group or riders): splitting it off here would
    compute it twice. One this split applies for every request that needs it stays."""
    best: list[Ride] = []
    for r in running:
        if not r.claimed or r.n > max(max_rows, 1) or (best and r.layer > best[0][0].layer):
            continue
        ready = {k[1] for k in r.claim if is_ready(k)}
        if not ready or len(ready) == len(r.claim):  # none, or a job that is ready
            continue
        if r.n > 1 and not (ready := _first(r, ready)):
            continue
        if best and r.layer < best[0][0].layer:
            best = []
        best.append((r, ready))
    if not best:
        return best
    layer = best[0][0].layer
    needers: Counter[int] = Counter()
    for r in running:
        # A longer prompt never joins a group or rides: its experts run for it alone.
        if r.layer == layer and r.n <= max(max_rows, 1):
            needers.update(set(r.needed) - r.done)
    while True:  # a prompt cut short leaves its later experts to others' needers
        here: Counter[int] = Counter(e for _, ready in best for e in ready)
        kept = [(r, {e for e in ready if here[e] == needers[e]}) for r, ready in best]
        kept = [(r, _first(r, ready) if r.n > 1 else ready) for r, ready in kept]
        if kept == best:
            return [(r, ready) for r, ready in best if ready]
        best = kept


def _first(r: Request, ready: set[int]) -> set[int]:
    """The experts in ``ready`` that come before every expert ``r`` has left and is not
    in it: a prompt applies its experts in expert order."""
    out = set()
    for e in r.needed:
        if e in r.done:
            continue
        if e not in ready:
            break
        out.add(e)
    return out


def progress(r: Request) -> tuple[int, int, int, int]:
    """How far a long prompt read in parts has got, least first: its layer (-1 while
    entering), its MoE before its rows, then its next expert or row. The engine reads
    the prompt furthest behind next, so prompts read at the same time meet at each layer
    and share its parts (``prompt_part``), as one batch would, instead of each in turn
    reading every expert of every layer for itself."""
    if r.entering:
        return (-1, 1, r.row, r.arrival)
    if len(r.done) < len(r.needed):
        return (r.layer, 0, next(e for e in r.needed if e not in r.done), r.arrival)
    return (r.layer, 1, r.row, r.arrival)


def prompt_part(
    leader: Request,
    others: Sequence[Request],
    is_ready: Callable[[tuple[int, int]], bool],
    counts: Callable[[Request], list[int]],
    budget: int,
) -> list[Ride]:
    """The experts long prompts apply next, on all of their rows: ``leader``'s claimed
    ones that are ready, in expert order up to the first still loading, joined by each
    of ``others`` (long prompts at its layer) whose next claimed experts are among them.
    Each takes a prefix of the experts it has left, so its rows' sums are added in
    expert order, as one whole job adds them. At least the leader's first expert, and
    no more routes (``counts``: a request's routes per expert) than ``budget`` after it.

    An expert several prompts take multiplies all their rows at once: on a CPU it is
    dequantized once for them, and BLAS runs one large product instead of several."""
    layer = leader.layer
    members = [leader, *(q for q in others if q.claim)]
    first = leader.claim[0][1]
    at = [0] * len(members)  # each member's next entry in its claim
    # One whose next expert comes before the part's first cannot join it.
    live = [q.claim[0][1] >= first for q in members]
    routes = [counts(q) for q in members]
    taken: list[set[int]] = [set() for _ in members]
    total = 0
    for e in sorted({k[1] for q in members for k in q.claim if k[1] >= first}):
        takers = [
            i
            for i, q in enumerate(members)
            if live[i] and at[i] < len(q.claim) and q.claim[at[i]][1] == e
        ]
        if not is_ready((layer, e)):
            for i in takers:
                live[i] = False  # its later experts must wait for this one
            if not live[0]:
                break
            continue
        n = sum(routes[i][e] for i in takers if e < len(routes[i]))
        if taken[0] and total + n > budget:
            break
        for i in takers:
            taken[i].add(e)
            at[i] += 1
        total += n
    return [(q, s) for q, s in zip(members, taken, strict=True) if s]


def make_policy(name: str) -> Policy:
    """The policy named ``name`` (``backend.policies`` lists them); ValueError if unknown."""
    return Policy(name, **policy_fields(name))
