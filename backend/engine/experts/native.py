"""The native expert backend: hand-written CPU kernels on experts' stored Q4 bytes.

A run's experts go to the kernels in one call (``native.moe``), riders' products and
prompts' sums so far included, with no Python or torch op per expert. A run the
whole-layer kernel does not take (a prompt after a one-token rider, an expert of other
block types than Q4_0 / Q4_1 with more rows than ``NATIVE_MAX_ROWS``) goes expert by
expert: the kernel for a few rows, dequantize-then-matmul (``EagerExperts``) for more,
where BLAS is the faster product. Both give the bits of each expert alone on its rows,
scaled and added in expert order.

Q4_0 / Q4_1 weights are multiplied in 8-bit integers, their input rounded to 8 bits per
block of 32 as llama.cpp's CPU kernels round theirs, by the same kernel however many
rows they have, so an expert's bits do not depend on the policy or the batch. They are
packed in their slot (``native.pack``: 16 rows to a group, for a kernel that gives the same
bits 1.2-1.4x as fast) before a product of ``PACK_ROWS`` rows or more (a prompt's), or
before their first use after the one that brought them in, or as they land where the
warm-up read them or where the cache has a slot for every expert, and stay packed until
the slot is filled again. Packing an expert takes the engine's thread for about as long as
the packed kernel saves over six one-row products, and under a small cache most fills
are evicted after one use: those stay as stored (docs/performance.md, "Q4 experts
packed at their second use").
"""

from __future__ import annotations

import ctypes
import itertools
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from backend.engine.experts.eager import EagerExperts
from backend.engine.request import Request
from backend.kernels import native
from backend.kernels.quants import dequantize

# Past this many rows, a prompt's expert is dequantized once for all its rows (see there).
NATIVE_MAX_ROWS = native.EXPERT_MAX_ROWS
# A product of this many rows repays packing its expert on its own.
PACK_ROWS = 8


class NativeExperts(EagerExperts):
    name = "native"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # (layer, expert) -> (the layout its bits were checked for, the kernels' type bits)
        self._kinds: dict[tuple[int, int], tuple[tuple, int]] = {}
        # The resident experts as the native decode walk reads them (``decode.Walk``):
        # [layer, expert] -> gate, up, down addresses and type bits; 0s while absent. The
        # cache says when an entry becomes ready or leaves its slot, on the engine
        # thread, which is also the only one that walks: the table never lags.
        n_experts = max((len(layer) for layer in self.experts), default=0)
        self.n_table_experts = n_experts
        self._n_experts = sum(len(layer) for layer in self.experts)
        self.table = (ctypes.c_uint64 * (4 * len(self.experts) * n_experts))()
        # Resident experts packed in their slots: the fill (slot, generation) they were
        # packed in (a slot is packed once per fill) and which of gate, up, down packed.
        self._packed: dict[tuple[int, int], tuple[tuple[int, int], tuple[bool, ...]]] = {}
        # Resident experts not packed yet: the cache's count of their uses at the fill
        # (``pack_used`` packs them once it grows).
        self._unpacked: dict[tuple[int, int], int] = {}
        self.cache.on_ready, self.cache.on_gone = self._resident, self._gone
        for key, slot in self.cache.slot_of.items():
            if self.cache.ready[slot]:
                self._resident(key, slot)

    def _resident(self, key: tuple[int, int], slot: int) -> None:
        at = self.layouts.get(key)
        bits = None if at is None else self._bits(key, at)
        if bits is None:  # the walk stops before this expert; the layer path takes it
            self._gone(key)
            return
        if self._packed.get(key, (None,))[0] != (slot, self.cache.generation[slot]):
            self._packed.pop(key, None)
            self._unpacked[key] = self.cache.uses(key)
        row = self.slots.data_ptr() + slot * self.slots.stride(0)
        i = 4 * (key[0] * self.n_table_experts + key[1])
        self.table[i : i + 4] = [row + at[0], row + at[1], row + at[2], self._types(key, bits)]
        if key in self._unpacked and self.cache.n_slots >= self._n_experts:
            self._pack(key)  # a slot for every expert: none is evicted, each used again

    def pack_used(self, uses: Iterable[tuple[int, int]]) -> None:
        """Before their kernels run (``uses``: each expert once per row its product
        takes now), pack each resident expert not packed yet whose product takes
        ``PACK_ROWS`` or more rows, or that was routed to again since its fill (the
        routing that brought it in comes before the fill). Others take the kernel on
        the blocks as stored: the same bits. With every resident expert packed (a cache
        holding them all), ``uses`` is not read."""
        if not self._unpacked:
            return
        for key, rows in Counter(uses).items():
            at_fill = self._unpacked.get(key)
            if at_fill is not None and (rows >= PACK_ROWS or self.cache.uses(key) > at_fill):
                self._pack(key)

    def warmed(self, key: tuple[int, int]) -> None:
        # Read while the engine waits (or behind requests' reads): nearly every warm-up
        # fill is used, and packing it now keeps it off the first requests' time.
        if key in self._unpacked:
            self._pack(key)

    def _pack(self, key: tuple[int, int]) -> None:
        del self._unpacked[key]
        slot = self.cache.slot_of[key]
        stored, at = self.slots[slot], self.layouts[key]
        self._packed[key] = (
            (slot, self.cache.generation[slot]),
            tuple(
                native.pack(stored[o : o + p.nbytes], p.qtype, p.shape)
                for o, p in zip(at, self.experts[key[0]][key[1]].parts, strict=True)
            ),
        )
        i = 4 * (key[0] * self.n_table_experts + key[1])
        self.table[i + 3] = self._types(key, self._kinds[key][1])

    def _gone(self, key: tuple[int, int]) -> None:
        self._packed.pop(key, None)
        self._unpacked.pop(key, None)
        i = 4 * (key[0] * self.n_table_experts + key[1])
        self.table[i : i + 4] = [0, 0, 0, 0]

    def _parts_packed(self, key: tuple[int, int]) -> tuple[bool, ...]:
        """Which of gate, up, down are packed in ``key``'s slot (none if not resident)."""
        entry = self._packed.get(key)
        return entry[1] if entry is not None else (False, False, False)

    def _types(self, key: tuple[int, int], bits: int) -> int:
        """The kernels' type bits for ``key`` as its slot holds it (packed or not)."""
        entry = self._packed.get(key)
        return bits if entry is None else native.packed_types(bits, entry[1])

    def dequantize(self, key: tuple[int, int], slot: int):
        packed = self._parts_packed(key)
        if not any(packed):
            return super().dequantize(key, slot)
        row, ref = self.slots[slot], self.experts[key[0]][key[1]]
        out = []
        for o, p, pk in zip(self.layouts[key], ref.parts, packed, strict=True):
            raw = row[o : o + p.nbytes]
            # the blocks as stored, for the eager product: a copy of this part alone
            out.append(
                dequantize(
                    native.unpack(raw, p.qtype, p.shape) if pk else raw,
                    p.qtype,
                    p.shape,
                    self.t.dtype,
                )
            )
        return out[0], out[1], out[2]

    def _too_many(self, key: tuple[int, int], rows: int) -> bool:
        """Whether ``rows`` of expert ``key`` go to dequantize-then-matmul: past
        ``NATIVE_MAX_ROWS``, unless a part reads its input rounded (``native.any_rows``),
        whose kernel keeps every product of the expert the same arithmetic, prompts'
        included, and beats BLAS at every row count measured (docs/performance.md)."""
        return rows > NATIVE_MAX_ROWS and not native.any_rows(
            p.qtype for p in self.experts[key[0]][key[1]].parts
        )

    def mlp(self, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
        if self._too_many((layer, e), x.shape[0]):
            return super().mlp(layer, e, x)
        self.pack_used(itertools.repeat((layer, e), x.shape[0]))
        packed = self._parts_packed((layer, e))
        out = native.expert_mlp(self.stored_parts(layer, e), x, self.t.config.native_act, packed)
        if out is None:  # the start-up checks should make this impossible
            self.refused(f"expert {(layer, e)}")
            return super().mlp(layer, e, x)
        return out

    def moe(
        self,
        layer: int,
        members: Sequence[Request],
        subsets: Sequence[set[int]],
        n_whole: int,
        x: torch.Tensor,
        w: torch.Tensor,
    ) -> torch.Tensor:
        y = self._whole_layer(layer, members, subsets, n_whole, x, w)
        return super().moe(layer, members, subsets, n_whole, x, w) if y is None else y

    def _bits(self, key: tuple[int, int], at: tuple) -> int | None:
        kind = self._kinds.get(key)
        if kind is None or kind[0] != at:
            parts = self.experts[key[0]][key[1]].parts
            kinds = tuple((p.qtype, p.shape, p.nbytes) for p in parts)
            bits = native.mlp_types(kinds, self.t.config.native_act)
            width = self.slots.shape[1]
            if bits is None or any(
                o < 0 or o + p.nbytes > width for o, p in zip(at, parts, strict=True)
            ):
                return None
            kind = self._kinds[key] = (at, bits)
        return kind[1]

    def _whole_layer(
        self,
        layer: int,
        members: Sequence[Request],
        subsets: Sequence[set[int]],
        n_whole: int,
        x: torch.Tensor,
        w: torch.Tensor,
    ) -> torch.Tensor | None:
        """``moe`` in one call to ``native.moe``; None if an expert has more routes than
        it takes (``_too_many``), or if a prompt among the others comes after a one-token
        one.

        A prompt among the others (applying some of its experts, ``scheduler.split``) has
        them added to its ``acc`` by the kernel, which goes on from the sums the prompt
        has: the order of the additions is the per-expert path's."""
        k = w.shape[1]
        n_sum = n_whole + sum(1 for r in members[n_whole:] if r.n > 1)
        if any(r.n > 1 for r in members[n_sum:]):
            return None
        # A long prompt's part nearly always has an expert past the kernel's rows: say so
        # before walking its routes one by one in Python.
        for r, s in zip(members, subsets, strict=True):
            if r.n > NATIVE_MAX_ROWS:
                counts = torch.bincount(r.route_ids.flatten()).tolist()
                if any(self._too_many((layer, e), counts[e]) for e in s if e < len(counts)):
                    return None
        by_expert: dict[int, list[int]] = {}
        i = 0  # route i is row i // k: rows ascending
        for m, (r, s) in enumerate(zip(members, subsets, strict=True)):
            for es in r.route_list:
                for e in es:
                    if m < n_whole or e in s:
                        by_expert.setdefault(e, []).append(i)
                    i += 1
        if any(self._too_many((layer, e), len(rs)) for e, rs in by_expert.items()):
            return None
        self.pack_used((layer, e) for e, rs in by_expert.items() for _ in rs)
        inner, hidden = self.experts[layer][0].gate.shape
        weights: list[int] = []
        types: list[int] = []
        counts: list[int] = []
        routes: list[int] = []
        first = 4 * layer * self.n_table_experts
        for e in sorted(by_expert):
            rs = by_expert[e]
            # The addresses and type bits the table keeps for a resident expert (the
            # walk's): what ``_resident`` checked and packed as the slot became ready.
            gate, up, down, bits = self.table[first + 4 * e : first + 4 * e + 4]
            if not gate:
                self.refused(f"expert {(layer, e)}'s layout")
                return None
            weights += (gate, up, down)
            types.append(bits)
            counts.append(len(rs))
            routes += rs
        whole_rows = sum(r.n for r in members[:n_whole])
        sum_rows = sum(r.n for r in members[:n_sum])
        into = None
        if n_sum > n_whole:  # the prompts' sums so far follow the whole members' zeros
            into = torch.cat(
                [x.new_zeros(whole_rows, hidden)]
                + [
                    x.new_zeros(r.n, hidden) if r.acc is None else r.acc
                    for r in members[n_whole:n_sum]
                ]
            )
        done = native.moe(weights, types, counts, routes, x, w, inner, hidden, sum_rows, into)
        if done is None:
            self.refused("a whole-layer run")
            return None
        y, parts = done
        row = whole_rows
        for r in members[n_whole:n_sum]:
            r.acc = y[row : row + r.n]
            row += r.n
        if n_sum < len(members):  # one row each: route i is row i // k
            j = 0
            for e, n in zip(sorted(by_expert), counts, strict=True):
                for i in routes[j : j + n]:
                    if i // k >= sum_rows:
                        # a copy: a view would keep all of ``parts`` alive with it
                        members[n_sum + i // k - sum_rows].parts[e] = parts[j : j + 1].clone()
                    j += 1
        return y[:whole_rows]
