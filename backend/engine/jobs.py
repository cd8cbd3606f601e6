"""The compute side of a job, batched over a group of requests at the same layer.

Legend: T tokens in the group, D hidden, K top-k, V vocab.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from backend.engine.cache import ExpertCache
from backend.engine.request import Request
from backend.kernels import native, qmatmul
from backend.kernels.quants import dequantize
from backend.models.transformer import SeqSlice, Transformer
from backend.models.weights import ExpertRef, ExpertWeights, dequantize_slot

# Routes (row, expert) gathered and multiplied per batch in ``JobRunner._moe``: a decoding
# run (16 requests x top-8) is one batch; a long prompt takes several.
ROUTES_PER_BATCH = 2048
# ``JobRunner._moe_grouped``: the most routes one expert may have there (decoding runs; a
# prompt's experts take ``_moe_torch``, where padding would waste work), and the most
# bytes of decoded weights one batched product may hold (more experts go in turns).
GROUPED_MAX_ROWS = 64
GROUPED_BYTES = 512 << 20


class JobRunner:
    """Runs jobs on experts held in cache slots in their stored (quantized) form.

    An expert with few rows in a group runs straight from its quantized bytes (``mlp``,
    ``qmatmul``); otherwise it is dequantized, which is compute work. Small groups at the
    same layer often use the same expert moments apart, so the dequantized weights of the
    last ``working_set`` uses are kept while their slot still holds that expert (checked
    by slot generation): this saves repeated decoding without holding a single expert the
    cache does not.
    """

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
        # (layer, expert) -> (its layout, the native kernels' type bits or None), and
        # whether whole MoE layers may go to them at all (stored slots in CPU memory).
        self._kinds: dict[tuple[int, int], tuple[tuple, int | None]] = {}
        self._native_moe = (
            slots.dtype == torch.uint8
            and slots.device.type == "cpu"
            and slots.dim() == 2
            and slots.is_contiguous()
        )
        # Stored slots on an accelerator: a job's experts are decoded and multiplied
        # together (``_moe_grouped``), a few device ops per job instead of per expert.
        self.grouped = slots.dtype == torch.uint8 and slots.device.type != "cpu"
        self.on_route: Callable[[Request], None] = lambda r: None

    def expert(self, layer: int, e: int) -> ExpertWeights:
        key = (layer, e)
        slot = self.cache.slot_of[key]
        if self.slots.is_floating_point():
            # Decoded slots: the weights are already there, as views.
            ref, row, at = self.experts[layer][e], self.slots[slot], self.layouts[key]
            return tuple(
                row[o : o + p.numel].view(p.shape) for o, p in zip(at, ref.parts, strict=True)
            )
        gen = self.cache.generation[slot]
        hit = self._decoded.get(key)
        if hit is not None and hit[0] == slot and hit[1] == gen:
            self._decoded.move_to_end(key)
            return hit[2]
        weights = dequantize_slot(
            self.slots[slot], self.experts[layer][e], self.layouts[key], self.t.dtype
        )
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

    def mlp(self, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """The expert's MLP on rows ``x``: straight from its quantized bytes for a few rows
        (decoding), else on dequantized weights (prefill, big groups, other block types)."""
        if x.shape[0] <= qmatmul.MAX_ROWS and not self.slots.is_floating_point():
            key = (layer, e)
            row = self.slots[self.cache.slot_of[key]]
            parts = tuple(
                (row[o : o + p.nbytes], p.qtype, p.shape)
                for o, p in zip(self.layouts[key], self.experts[layer][e].parts, strict=True)
            )
            out = qmatmul.expert_mlp(parts, x)
            if out is not None:
                return out
        return self.t.expert_mlp(self.expert(layer, e), x)

    def enter(
        self, group: Sequence[Request], layer: int, seqs: Sequence[SeqSlice], h: torch.Tensor
    ) -> None:
        """Attention(layer) on the group's rows h, then each request's MoE input and
        routing for ``layer`` (``Transformer.attention_route``)."""
        h, x, ids, w = self.t.attention_route(layer, h, seqs)  # ids, w [T, K]
        listed = None if ids is None else ids.tolist()
        row = 0
        for r in group:
            end = row + r.n
            r.layer, r.h, r.x = layer, h[row:end], x[row:end]
            r.acc, r.done, r.parts, r.claim, r.claimed = None, set(), {}, [], False
            if listed is not None:
                r.route_ids, r.route_w, r.route_list = ids[row:end], w[row:end], listed[row:end]
                r.needed = tuple(sorted({e for es in r.route_list for e in es}))
            else:
                r.route_ids = r.route_w = None
                r.route_list, r.needed = [], ()
            row = end
            self.on_route(r)

    @torch.inference_mode()
    def start(self, group: Sequence[Request], token_ids: list[list[int]]) -> None:
        """Embed new tokens (a prompt, or one sampled token) and run attention + router of layer 0."""
        t = self.t
        h = t.embed(torch.tensor([i for ids in token_ids for i in ids], device=t.device))
        self.enter(group, 0, [SeqSlice(r.kv, r.start, r.n) for r in group], h)

    @torch.inference_mode()
    def run(
        self, group: Sequence[Request], riders: Sequence[tuple[Request, set[int]]] = ()
    ) -> tuple[list[Request], torch.Tensor | None]:
        """Run the group's claimed experts. Requests whose layer is complete advance to the
        next layer; after the last layer their logits are returned [len(done), V].

        ``riders``: other requests at the same layer, each with some of its experts that
        the group computes anyway; their rows join those experts' products, so each
        expert's bytes are read once for all of them (see ``Policy.ride``)."""
        t, layer = self.t, (group[0] if group else riders[0][0]).layer
        if t.config.sparse_layers[layer]:
            done = self._moe(layer, group, riders)
            outs = []
            for r in done:
                shared = t.shared_expert(layer, r.x)
                outs.append(r.h + (r.acc if shared is None else r.acc + shared))
        else:
            done = list(group)
            outs = [r.h + t.dense_mlp(layer, r.x) for r in group]
        if not done:
            return [], None
        h = outs[0] if len(outs) == 1 else torch.cat(outs)
        if layer + 1 < t.config.n_layers:
            self.enter(done, layer + 1, [SeqSlice(r.kv, r.start, r.n) for r in done], h)
            return done, None
        ends = torch.tensor([r.n for r in done], device=h.device).cumsum(0) - 1
        return done, t.logits(h[ends])

    def _moe(
        self, layer: int, group: Sequence[Request], riders: Sequence[tuple[Request, set[int]]]
    ) -> list[Request]:
        """Apply this run's experts; set ``acc`` of the requests whose MoE is complete.

        A request that gets all its experts in this run sums them straight into ``y``
        (in expert order, as the sequential model does). A one-token request that gets
        them over several runs (riding) keeps each expert's contribution in ``parts`` and
        sums them in the same expert order when the last arrives, as a whole job would.
        Longer ones (a prompt streaming through a cache smaller than its experts)
        accumulate as they go: a few KB per expert and token would add up to gigabytes
        for a long prompt on a wide model."""
        subsets = [{e for _, e in r.claim} for r in group] + [s for _, s in riders]
        members = [*group, *(r for r, _ in riders)]
        whole = [
            not r.done and len(s) == len(r.needed) for r, s in zip(members, subsets, strict=True)
        ]
        first = sorted(range(len(members)), key=lambda i: not whole[i])  # whole ones first
        members = [members[i] for i in first]
        subsets = [subsets[i] for i in first]
        n_whole = sum(whole)
        if len(members) == 1:
            x, w = members[0].x, members[0].route_w
        else:
            x = torch.cat([r.x for r in members])
            w = torch.cat([r.route_w for r in members])
        y = None
        if all(r.n == 1 for r in members[n_whole:]):
            y = self._moe_native(layer, members, subsets, n_whole, x, w)
        routes = None  # sorted once for both paths below (``_sorted_routes``)
        if y is None and self.grouped:
            routes = self._sorted_routes(members, subsets, w)
            y = self._moe_grouped(layer, members, n_whole, x, routes)
        if y is None:
            y = self._moe_torch(layer, members, subsets, n_whole, x, w, routes)
        row = 0
        for r, s in zip(members[:n_whole], subsets[:n_whole], strict=True):
            r.acc, r.done = y[row : row + r.n], set(s)
            row += r.n
        for r, s in zip(members[n_whole:], subsets[n_whole:], strict=True):
            r.done |= s
            if r.n == 1 and len(r.done) == len(r.needed):
                acc = r.x.new_zeros(1, r.x.shape[1])
                for e in sorted(r.parts):
                    acc += r.parts[e]
                r.acc = acc
            elif r.n > 1 and r.acc is None:  # none of its rows routed to this run's experts
                r.acc = r.x.new_zeros(r.n, r.x.shape[1])
        return [r for r in members if len(r.done) == len(r.needed)]

    def _moe_torch(
        self,
        layer: int,
        members: Sequence[Request],
        subsets: Sequence[set[int]],
        n_whole: int,
        x: torch.Tensor,
        w: torch.Tensor,
        routes: tuple | None = None,
    ) -> torch.Tensor:
        """``_moe``'s products one expert at a time (``mlp``): the whole members' sum
        ``y`` [their rows, D]; the others get their ``parts`` or ``acc`` (``_spans``).
        ``routes``: ``_sorted_routes``'s result, where the caller has it already."""
        experts, counts, rows, ws = routes or self._sorted_routes(members, subsets, w)
        whole_rows = sum(r.n for r in members[:n_whole])
        y = x.new_zeros(whole_rows, x.shape[1])
        others = members[n_whole:]  # riders and streamed prompts: see ``_spans``
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
                self._spans(others, whole_rows, rows[sl], out, chunk, y)
            else:
                y.index_add_(0, rows[sl], out)
            at, size, chunk = at + size, 0, []
        return y

    @staticmethod
    def _sorted_routes(
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

    def _moe_grouped(
        self,
        layer: int,
        members: Sequence[Request],
        n_whole: int,
        x: torch.Tensor,
        routes: tuple,
    ) -> torch.Tensor | None:
        """``_moe_torch``'s work with a fixed number of device ops per job instead of a
        dozen per expert part, for stored slots on an accelerator, where launching those
        small ops from Python bounded the speed: each part's bytes are gathered from the
        experts' slots in one copy and decoded for all of them at once (their matrices
        stacked are one matrix of the same block type), and the MLPs run as
        batched products over experts, each expert's rows padded to the most any has.
        The routes, the scaling and the order of the sums are ``_moe_torch``'s (the
        products round as the device's batched matmul does). None where the experts'
        parts differ in block type or shape, or an expert has more than
        ``GROUPED_MAX_ROWS`` routes. ``routes``: ``_sorted_routes``'s result."""
        experts, counts, rows, ws = routes
        if not experts or max(counts) > GROUPED_MAX_ROWS:
            return None
        parts = self.experts[layer][experts[0]].parts
        kinds = [(p.qtype, tuple(p.shape), p.nbytes) for p in parts]
        for e in experts[1:]:
            if [(p.qtype, tuple(p.shape), p.nbytes) for p in self.experts[layer][e].parts] != kinds:
                return None
        # Each expert's slot row and the offsets of its parts there (they differ between
        # experts read from the model file: see the store's aligned reads).
        places = [
            (self.slots[self.cache.slot_of[(layer, e)]], self.layouts[(layer, e)]) for e in experts
        ]
        device, dtype = self.slots.device, self.t.dtype
        # Each part is decoded in float32, then cast: count the wider of the two.
        decoded = sum(p.numel for p in parts) * max(4, torch.finfo(dtype).bits // 8)
        step = max(1, GROUPED_BYTES // decoded)
        whole_rows = sum(r.n for r in members[:n_whole])
        y = x.new_zeros(whole_rows, x.shape[1])
        others = members[n_whole:]
        first = 0  # the chunk's first route
        for a in range(0, len(experts), step):
            cs = counts[a : a + step]
            n_exp, n_routes = len(cs), sum(cs)
            gate, up, down = (
                dequantize(
                    torch.cat([row[at[i] : at[i] + p.nbytes] for row, at in places[a : a + n_exp]]),
                    p.qtype,
                    (n_exp * p.shape[0], p.shape[1]),
                    dtype,
                ).view(n_exp, *p.shape)
                for i, p in enumerate(parts)
            )
            # Route j of the chunk is expert which[j]'s route number pos[j].
            which = torch.repeat_interleave(torch.arange(n_exp), torch.tensor(cs))
            starts = torch.tensor([0, *cs[:-1]]).cumsum(0)
            pos = torch.arange(n_routes) - starts[which]
            which, pos = which.to(device), pos.to(device)
            sl = slice(first, first + n_routes)
            xp = x.new_zeros(n_exp, max(cs), x.shape[1])
            xp[which, pos] = x[rows[sl]]
            act = F.silu(torch.bmm(xp, gate.transpose(1, 2))) * torch.bmm(xp, up.transpose(1, 2))
            out = torch.bmm(act, down.transpose(1, 2))[which, pos] * ws[sl, None]
            if others:
                self._spans(
                    others,
                    whole_rows,
                    rows[sl],
                    out,
                    list(zip(experts[a : a + n_exp], cs, strict=True)),
                    y,
                )
            else:
                y.index_add_(0, rows[sl], out)
            first += n_routes
        return y

    def _moe_native(
        self,
        layer: int,
        members: Sequence[Request],
        subsets: Sequence[set[int]],
        n_whole: int,
        x: torch.Tensor,
        w: torch.Tensor,
    ) -> torch.Tensor | None:
        """``_moe_torch``'s work in one call to the native kernels (``native.moe``), with
        no Python or torch op per expert, for whole members and one-token others: the
        same bits (each expert on its rows, scaled, added or kept per expert in expert
        order). None where ``_moe_torch`` must run instead: decoded or device slots, a
        block type the kernels do not take, an expert with more than ``qmatmul.MAX_ROWS``
        rows (those take BLAS there), no kernels."""
        if not self._native_moe:
            return None
        k = w.shape[1]
        by_expert: dict[int, list[int]] = {}
        i = 0  # route i is row i // k: rows ascending
        for m, (r, s) in enumerate(zip(members, subsets, strict=True)):
            for es in r.route_list:
                for e in es:
                    if m < n_whole or e in s:
                        by_expert.setdefault(e, []).append(i)
                    i += 1
        base, stride = self.slots.data_ptr(), self.slots.stride(0)
        width = self.slots.shape[1]
        inner, hidden = self.experts[layer][0].gate.shape
        weights: list[int] = []
        types: list[int] = []
        counts: list[int] = []
        routes: list[int] = []
        for e in sorted(by_expert):
            rs = by_expert[e]
            key = (layer, e)
            at = self.layouts[key]
            kind = self._kinds.get(key)
            if kind is None or kind[0] != at:
                parts = self.experts[layer][e].parts
                bits = native.mlp_types(tuple((p.qtype, p.shape, p.nbytes) for p in parts))
                if any(o < 0 or o + p.nbytes > width for o, p in zip(at, parts, strict=True)):
                    bits = None
                if tuple(parts[0].shape) != (inner, hidden):  # the shape the call passes
                    bits = None
                kind = self._kinds[key] = (at, bits)
            if kind[1] is None or len(rs) > qmatmul.MAX_ROWS:
                return None
            row = base + self.cache.slot_of[key] * stride
            weights += (row + at[0], row + at[1], row + at[2])
            types.append(kind[1])
            counts.append(len(rs))
            routes += rs
        whole_rows = sum(r.n for r in members[:n_whole])
        done = native.moe(weights, types, counts, routes, x, w, inner, hidden, whole_rows)
        if done is None:
            return None
        y, parts = done
        if n_whole < len(members):  # one row each: route i is row i // k
            j = 0
            for e, n in zip(sorted(by_expert), counts, strict=True):
                for i in routes[j : j + n]:
                    if i // k >= whole_rows:
                        # a copy: a view would keep all of ``parts`` alive with it
                        members[n_whole + i // k - whole_rows].parts[e] = parts[j : j + 1].clone()
                    j += 1
        return y

    @staticmethod
    def _spans(
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
