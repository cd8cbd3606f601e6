"""The compute side of a job, batched over a group of requests at the same layer.

Legend: T tokens in the group, D hidden, K top-k, V vocab.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

from backend.engine.experts.eager import EagerExperts
from backend.engine.request import Request
from backend.kernels.decode import Walk
from backend.models.transformer import SeqSlice, Transformer

# A prompt's last slice takes in what would be left after it under this many rows (or a
# quarter of a slice, for slices under four times this): below a few dozen rows the
# CPU's BLAS rounds a product's rows by how many there are (docs/performance.md, "BLAS
# rounds a few rows by how many there are"), so a short last slice would get other bits
# than the same rows read in one job.
MIN_LAST_SLICE = 128


def _short_rest(rows: int) -> int:
    """Rows left after a slice of ``rows`` that it takes in: fewer than this."""
    return min(MIN_LAST_SLICE, rows // 4)


def slice_end(row: int, rows: int, n: int) -> int:
    """Where the slice of up to ``rows`` rows from ``row`` of an ``n``-row prompt ends."""
    end = min(row + rows, n)
    return n if n - end < _short_rest(rows) else end


def longest_slice(rows: int) -> int:
    """The most rows a slice of ``rows`` may take (``slice_end``)."""
    return rows + max(0, _short_rest(rows) - 1)


class JobRunner:
    """Runs jobs for groups of requests at one layer: the routed experts through the
    engine's expert backend (``backend.engine.experts``), then the shared expert,
    attention and router of the next layer, or the head after the last."""

    def __init__(self, t: Transformer, experts: EagerExperts) -> None:
        self.t = t
        self.experts = experts
        self.unhook()
        # Set by another thread when a message arrives: a walk stops at the next layer.
        self.stop = ctypes.c_int(0)
        self._walk: Walk | None = None

    def unhook(self) -> None:
        """No callbacks (the engine's own methods make a cycle that ``Engine.close`` breaks)."""
        self.on_route: Callable[[Request], None] = lambda r: None
        # A layer a walk went through (``run_through``), for each of its requests with
        # that layer's experts: the cache's uses and hits, as a job there would count them.
        self.on_pass: Callable[[Request, int, tuple[int, ...]], None] = lambda r, l, n: None

    def enter(
        self, group: Sequence[Request], layer: int, seqs: Sequence[SeqSlice], h: torch.Tensor
    ) -> None:
        """Attention(layer) on the group's rows h, then each request's MoE input and
        routing for ``layer`` (``Transformer.attention_route``)."""
        self._assign(group, layer, *self.t.attention_route(layer, h, seqs))

    def _assign(
        self,
        group: Sequence[Request],
        layer: int,
        h: torch.Tensor,
        x: torch.Tensor,
        ids: torch.Tensor | None,
        w: torch.Tensor | None,
    ) -> None:
        """Place the group's rows (in order) at ``layer``, before its MoE."""
        listed = None if ids is None else ids.tolist()
        row = 0
        for r in group:
            end = row + r.n
            r.layer, r.h, r.x = layer, h[row:end], x[row:end]
            r.acc, r.done, r.parts = None, set(), {}
            r.row, r.staged, r.emb = 0, [], None
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
    def apply(self, part: Sequence[tuple[Request, set[int]]]) -> None:
        """Part of long prompts' MoE at one layer: for each prompt, its experts in the
        part, the next ones in expert order among those it has left, on all of its
        rows, added to its sums (``acc``) as a whole job adds them, so that once every
        expert is applied ``acc`` holds the whole job's bits and ``run_rows`` goes on
        from it. An expert several prompts take multiplies all their rows at once."""
        self._moe(part[0][0].layer, [], part)

    @torch.inference_mode()
    def run_rows(self, r: Request, rows: int) -> torch.Tensor | None:
        """The next ``rows`` rows of a prompt's job (``r.row`` on; the rest with them if
        few would be left, ``slice_end``), with the layer's MoE applied (``apply``;
        nothing while ``r.entering``): the rest of the layer, then attention and router
        of the next layer, whose KV they write after the rows before them. Once every
        row is done the request moves to that layer; after the last layer the prompt's
        logits [1, V] come back instead.

        Each row's result is the bits it gets in the whole job: the norms and
        projections work row by row, and a row's attention reads the KV of the rows
        before it, which the earlier slices wrote. On the CPU that holds where slices
        are a multiple of 512 rows (``EngineConfig.prefill_chunk``): torch's attention
        kernel reads keys in blocks of 512 and rounds a block by its length, so a
        slice ending inside a block rounds its last rows' attention differently."""
        t, layer = self.t, r.layer
        a, b = r.row, slice_end(r.row, rows, r.n)
        if r.entering:
            out, nxt = r.emb[a:b], 0
        else:
            x = r.x[a:b]
            y = r.acc[a:b] if t.config.sparse_layers[layer] else None
            out = t.ffn_output(layer, r.h[a:b], x, y, prompt=True)
            nxt = layer + 1
        r.row = b
        last = b == r.n
        if nxt == t.config.n_layers:
            return t.logits(out[-1:]) if last else None
        r.staged.append(t.attention_route(nxt, out, [SeqSlice(r.kv, r.start + a, b - a)]))
        if last:
            parts = list(zip(*r.staged, strict=True))
            cat = [None if p[0] is None else torch.cat(p) for p in parts]
            self._assign([r], nxt, *cat)
        return None

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
        sparse = t.config.sparse_layers[layer]
        done = self._moe(layer, group, riders) if sparse else list(group)
        outs = [
            t.ffn_output(layer, r.h, r.x, r.acc if sparse else None, prompt=r.n != 1) for r in done
        ]
        if not done:
            return [], None
        h = outs[0] if len(outs) == 1 else torch.cat(outs)
        if layer + 1 < t.config.n_layers:
            self.enter(done, layer + 1, [SeqSlice(r.kv, r.start, r.n) for r in done], h)
            return done, None
        ends = torch.tensor([r.n for r in done], device=h.device).cumsum(0) - 1
        return done, t.logits(h[ends])

    def walk(self) -> Walk | None:
        """The native decode walk over this model's layers and the expert backend's table
        of resident experts; None where the backend keeps none or the kernels do not take
        the model. Made again if the model's block weights change."""
        table = getattr(self.experts, "table", None)
        if table is None or not self.t.config.is_moe:
            return None
        blocks = self.t.decode_blocks()
        kept = self._walk
        if kept is None or any(a is not b for a, b in zip(kept.blocks, blocks, strict=True)):
            c = self.t.config
            moe = [s and not c.shared_expert_size for s in c.sparse_layers]
            inner = self.experts.experts[0][0].gate.shape[0] if self.experts.experts[0] else 0
            kept = self._walk = Walk(
                blocks, moe, table, self.experts.n_table_experts, inner, self.stop
            )
        return kept if kept.ok else None

    @torch.inference_mode()
    def run_through(
        self, group: Sequence[Request]
    ) -> tuple[list[Request], torch.Tensor | None] | None:
        """``run`` for a group of decoding requests, then on through the next layers in one
        native call (``decode.Walk``) for as long as every expert they route to is resident:
        the same kernels on the same arguments, so the same bits. Each layer passed counts
        its experts' uses as a job there would (``on_pass``); the requests end before the
        first layer with a missing expert (claimed and fetched as usual), or after the last
        with their logits. None where the walk does not take the group (the caller runs
        ``run``): it must be the group's own claimed experts that the first layer runs.

        The expert backend packs (``NativeExperts.pack_used``) the first layer's experts
        before the walk and the layers' it passed after it, each once used again since its
        fill: the walk reads each expert as its slot holds it, packed or not."""
        walk = self.walk()
        layer = group[0].layer
        if (
            walk is None
            or not walk.moe[layer]
            or any(r.n != 1 or r.route_ids is None for r in group)
        ):
            return None
        t, L = self.t, walk.L
        like = group[0].x.new_empty(t.config.n_kv_heads, 0, t.config.head_dim, dtype=t.kv_dtype)
        caches = [None] * L
        for layer_after in range(layer + 1, L):
            caches[layer_after] = [
                r.kv.reserve(layer_after, r.start, r.start + 1, like) for r in group
            ]
        # Fresh contiguous copies: the walk writes its rows' state into them.
        h, x, ids, w = (
            torch.cat([getattr(r, name) for r in group]).contiguous()
            for name in ("h", "x", "route_ids", "route_w")
        )
        pos = [r.start for r in group]
        rope = t.rope_table(max(pos) + 1, h.dtype)
        self.experts.pack_used((layer, e) for r in group for e in r.needed)
        reached, trail = walk.run(layer, h, x, ids, w, caches, pos, rope)
        if reached == layer:
            return None
        # each passed layer's experts, per row of the group
        passed = {
            p: [tuple(sorted(set(routes))) for routes in trail[p].tolist()]
            for p in range(layer + 1, min(reached, L))
        }
        for p, needs in passed.items():
            for r, needed in zip(group, needs, strict=True):
                self.on_pass(r, p, needed)
        self.experts.pack_used((p, e) for p, needs in passed.items() for n in needs for e in n)
        if reached < L:
            self._assign(group, reached, h, x, ids, w)
            return list(group), None
        return list(group), t.logits(h)

    def _moe(
        self, layer: int, group: Sequence[Request], riders: Sequence[tuple[Request, set[int]]]
    ) -> list[Request]:
        """Apply this run's experts; set ``acc`` of the requests whose MoE is complete
        (a prompt's holds its sums so far until then).

        A request that gets all its experts in this run sums them straight into ``y``
        (in expert order, as the sequential model does). A one-token request that gets
        them over several runs (riding, split) keeps each expert's contribution in
        ``parts`` and sums them in the same expert order when the last arrives, as a
        whole job would. Longer ones (a prompt applying the experts that come first in
        expert order: split runs, chunked prefill, a cache smaller than its experts)
        add them into ``acc`` as they go: a few KB per expert and token would add up to
        gigabytes for a long prompt on a wide model."""
        subsets = [{e for _, e in r.claim} for r in group] + [s for _, s in riders]
        members = [*group, *(r for r, _ in riders)]
        whole = [
            not r.done and len(s) == len(r.needed) for r, s in zip(members, subsets, strict=True)
        ]
        # Whole ones first, then prompts applying some of their experts, then one-token ones.
        first = sorted(range(len(members)), key=lambda i: (not whole[i], members[i].n == 1))
        members = [members[i] for i in first]
        subsets = [subsets[i] for i in first]
        n_whole = sum(whole)
        if len(members) == 1:
            x, w = members[0].x, members[0].route_w
        else:
            x = torch.cat([r.x for r in members])
            w = torch.cat([r.route_w for r in members])
        y = self.experts.moe(layer, members, subsets, n_whole, x, w)
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
