"""The eager expert backend, and what every backend shares: a run's routes sorted by
expert, products scaled and summed in expert order, riders' parts kept apart.

Each expert runs on its rows in turn: dequantized (its float weights kept for the last
``working_set`` uses while its slot still holds it), then torch's matmuls. Every device
and block type takes this path; the other backends replace the products where they can,
never the order of the sums, so a request's bits do not depend on the backend's batch.

Legend: R rows in the run, D hidden, K top-k.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import torch

from backend.engine.cache import ExpertCache
from backend.engine.request import Request
from backend.models.transformer import Transformer
from backend.models.weights import ExpertRef, ExpertWeights, dequantize_slot

# Routes (row, expert) gathered and multiplied per batch in ``moe``: a decoding run
# (16 requests x top-8) is one batch; a long prompt takes several.
ROUTES_PER_BATCH = 2048

log = logging.getLogger(__name__)

Part = tuple[torch.Tensor, object, tuple[int, int]]  # (raw bytes, qtype, shape)


class EagerExperts:
    """Experts in cache slots (stored bytes, or decoded weights) applied one at a time."""

    name = "eager"

    def __init__(
        self,
        t: Transformer,
        experts: list[list[ExpertRef]],
        cache: ExpertCache,
        slots: torch.Tensor,
        layouts: dict,
        working_set: int = 0,
    ) -> None:
        self.t = t
        self.experts = experts
        self.cache = cache
        self.slots = slots
        self.layouts = layouts
        self.working_set = working_set
        self._decoded: OrderedDict[tuple[int, int], tuple[int, int, ExpertWeights]] = OrderedDict()
        self.n_refused = 0  # products the backend's kernels refused, computed eagerly

    @property
    def n_decoded(self) -> int:
        """Experts held decoded in the working set now."""
        return len(self._decoded)

    def refused(self, what: str) -> None:
        """The chosen kernels refused ``what`` although the start-up checks let them run:
        that product is computed eagerly (the same result, slower), warned about once,
        rather than failing the engine for every request."""
        if not self.n_refused:
            log.warning("%s expert backend refused %s; computing it eagerly", self.name, what)
        self.n_refused += 1

    # --- one expert ---------------------------------------------------------------------

    def expert(self, layer: int, e: int) -> ExpertWeights:
        """The expert's float weights: views of a decoded slot, or its stored bytes
        dequantized (kept in the working set while the slot holds the same contents)."""
        key = (layer, e)
        slot = self.cache.slot_of[key]
        if self.slots.is_floating_point():
            ref, row, at = self.experts[layer][e], self.slots[slot], self.layouts[key]
            return tuple(
                row[o : o + p.numel].view(p.shape) for o, p in zip(at, ref.parts, strict=True)
            )
        gen = self.cache.generation[slot]
        hit = self._decoded.get(key)
        if hit is not None and hit[0] == slot and hit[1] == gen:
            self._decoded.move_to_end(key)
            return hit[2]
        weights = self.dequantize(key, slot)
        if self.working_set:
            # Float parts may view the slot; a copy keeps the entry valid on its own.
            shared = self.slots.untyped_storage().data_ptr()
            weights = tuple(
                w.clone() if w.untyped_storage().data_ptr() == shared else w for w in weights
            )
            self._decoded[key] = (slot, gen, weights)
            while len(self._decoded) > self.working_set:
                self._decoded.popitem(last=False)
        return weights

    def dequantize(self, key: tuple[int, int], slot: int) -> ExpertWeights:
        """The float weights of the expert ``key`` that ``slot`` holds."""
        ref = self.experts[key[0]][key[1]]
        return dequantize_slot(self.slots[slot], ref, self.layouts[key], self.t.dtype)

    def warmed(self, key: tuple[int, int]) -> None:
        """The warm-up read ``key`` into its slot, ahead of any request: a backend that
        prepares a slot's bytes for its kernels does it now. These keep them as read."""

    def stored_parts(self, layer: int, e: int) -> tuple[Part, Part, Part]:
        """The expert's gate, up and down as (bytes in its slot, block type, shape)."""
        key = (layer, e)
        row = self.slots[self.cache.slot_of[key]]
        return tuple(
            (row[o : o + p.nbytes], p.qtype, p.shape)
            for o, p in zip(self.layouts[key], self.experts[layer][e].parts, strict=True)
        )

    def mlp(self, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """The expert's MLP on rows ``x`` [R, D]."""
        return self.t.expert_mlp(self.expert(layer, e), x, layer, e)

    # --- a run --------------------------------------------------------------------------

    def moe(
        self,
        layer: int,
        members: Sequence[Request],
        subsets: Sequence[set[int]],
        n_whole: int,
        x: torch.Tensor,
        w: torch.Tensor,
    ) -> torch.Tensor:
        """A run's products: the whole members' (the first ``n_whole``) sum ``y`` [their
        rows, D], returned; the others get their ``parts`` or ``acc`` (``spans``)."""
        return self.per_expert(layer, members, n_whole, x, self.sorted_routes(members, subsets, w))

    def per_expert(
        self, layer: int, members: Sequence[Request], n_whole: int, x: torch.Tensor, routes: tuple
    ) -> torch.Tensor:
        """``moe`` one expert at a time (``mlp``) on ``sorted_routes``'s ``routes``."""
        experts, counts, rows, ws = routes
        whole_rows = sum(r.n for r in members[:n_whole])
        y = x.new_zeros(whole_rows, x.shape[1])
        others = members[n_whole:]  # riders and streamed prompts: see ``spans``
        # Experts are taken in consecutive batches of at most ROUTES_PER_BATCH routes (one
        # expert may exceed it): a long prompt's gathered inputs and products stay bounded,
        # as one expert's were before, while a decoding run is one batch.
        at = size = 0
        chunk: list[tuple[int, int]] = []
        for i, (e, n) in enumerate(zip(experts, counts, strict=True)):
            chunk.append((e, n))
            size += n
            if i + 1 < len(experts) and size + counts[i + 1] <= ROUTES_PER_BATCH:
                continue
            sl = slice(at, at + size)
            xs, off, outs = x[rows[sl]], 0, []
            for ce, cn in chunk:
                outs.append(self.mlp(layer, ce, xs[off : off + cn]))
                off += cn
            out = (outs[0] if len(outs) == 1 else torch.cat(outs)) * ws[sl, None]
            # index_add_ runs through its entries in order: each row gets its experts'
            # outputs added one by one in expert order, as the sequential model adds them.
            if others:
                self.spans(others, whole_rows, rows[sl], out, chunk, y)
            else:
                y.index_add_(0, rows[sl], out)
            at, size, chunk = at + size, 0, []
        return y

    @staticmethod
    def sorted_routes(
        members: Sequence[Request], subsets: Sequence[set[int]], w: torch.Tensor
    ) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
        """Every (row, expert) route of this run, sorted by expert, rows ascending within
        each (a stable sort), so each expert takes a contiguous slice: (experts, their
        route counts, each route's row, each route's weight)."""
        # Routes to experts outside a request's subset this run are hidden (-1).
        ids = [
            r.route_ids
            if len(s) == len(r.needed)
            else r.route_ids.masked_fill(
                ~torch.isin(r.route_ids, torch.tensor(sorted(s), device=w.device)), -1
            )
            for r, s in zip(members, subsets, strict=True)
        ]
        ids = ids[0] if len(ids) == 1 else torch.cat(ids)
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        experts, counts = experts.tolist(), counts.tolist()
        if experts and experts[0] < 0:  # hidden routes sort first: drop them
            order, experts, counts = order[counts[0] :], experts[1:], counts[1:]
        return experts, counts, order // k, w.flatten()[order]

    @staticmethod
    def spans(
        others: Sequence[Request],
        whole_rows: int,
        rows: torch.Tensor,
        out: torch.Tensor,
        chunk: list[tuple[int, int]],
        y: torch.Tensor,
    ) -> None:
        """Route ``out`` (the weighted products of ``chunk``'s (expert, count) routes, in
        expert order) to the whole requests' ``y`` and to ``others``: a one-token request
        keeps each expert's row in ``parts``; a longer one adds into ``acc`` in order."""
        if whole_rows:
            sel = (rows < whole_rows).nonzero().squeeze(1)
            y.index_add_(0, rows[sel], out[sel])
        one: dict[int, Request] = {}
        lo = whole_rows
        for r in others:
            if r.n == 1:
                one[lo] = r
            else:
                sel = ((rows >= lo) & (rows < lo + r.n)).nonzero().squeeze(1)
                if r.acc is None:
                    r.acc = out.new_zeros(r.n, out.shape[1])
                if sel.numel():
                    r.acc.index_add_(0, rows[sel] - lo, out[sel])
            lo += r.n
        if one:
            expert_of = [e for e, n in chunk for _ in range(n)]
            for j, row in enumerate(rows.tolist()):
                r = one.get(row)
                if r is not None:
                    r.parts[expert_of[j]] = out[j : j + 1].clone()  # not a view of all of out
