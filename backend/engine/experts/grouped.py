"""The grouped expert backend: a job's experts decoded and multiplied together, for
stored slots on an accelerator.

There, launching a dozen small ops per expert part from Python bounded the speed: each
part's bytes are gathered from the experts' slots in one copy and decoded for all of
them at once (their matrices stacked are one matrix of the same block type), and the
MLPs run as batched products over experts, each expert's rows padded to the most any
has. The routes, the scaling and the order of the sums are ``EagerExperts``'; the
products round as the device's batched matmul does. A prompt's experts (more routes
than ``GROUPED_MAX_ROWS``, where padding would waste work) go expert by expert.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from backend.engine.experts.eager import EagerExperts
from backend.engine.request import Request
from backend.kernels.quants import dequantize

# The most routes one expert may have in a grouped product, and the most bytes of
# decoded weights one batched product may hold (more experts go in turns).
GROUPED_MAX_ROWS = 64
GROUPED_BYTES = 512 << 20


class GroupedExperts(EagerExperts):
    name = "grouped"

    def moe(
        self,
        layer: int,
        members: Sequence[Request],
        subsets: Sequence[set[int]],
        n_whole: int,
        x: torch.Tensor,
        w: torch.Tensor,
    ) -> torch.Tensor:
        routes = self.sorted_routes(members, subsets, w)
        experts, counts = routes[0], routes[1]
        if not experts or max(counts) > GROUPED_MAX_ROWS:
            return self.per_expert(layer, members, n_whole, x, routes)
        return self.grouped(layer, members, n_whole, x, routes)

    def grouped(
        self, layer: int, members: Sequence[Request], n_whole: int, x: torch.Tensor, routes: tuple
    ) -> torch.Tensor:
        """``per_expert``'s work with a fixed number of device ops per job."""
        experts, counts, rows, ws = routes
        parts = self.experts[layer][experts[0]].parts
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
                self.spans(
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
