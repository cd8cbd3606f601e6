"""A decoding group's walk through a model's layers in one native call (``decode.c``).

Each layer's MoE (``native.moe``'s kernel, experts in ascending order, routes in row
order), the residual, then the next layer's attention block and routing
(``native.attention_block``'s kernel), for as long as every expert the rows route to is
resident: the kernels the engine calls layer by layer, with the same arguments, so the
same bits, without the Python between them. ``Walk`` holds what stays fixed for a model
(each layer's block weights, the expert table's address); ``Walk.run`` takes the rows.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from backend.kernels import native

_I, _F, _P = ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class DecodeArgs(ctypes.Structure):
    """``bevy_decode_args`` in ``kernels.h``: change both together."""

    _fields_ = [
        *((n, _I) for n in ("T", "D", "L", "K", "E", "H", "G", "dh", "inner", "interleaved")),
        ("norm_topk", _I),
        ("kv_half", _I),
        ("eps", _F),
        ("scale", _F),
        *((n, _P) for n in ("table", "layers", "layer_ints", "cos", "sin", "kbuf", "vbuf")),
        *((n, _P) for n in ("caps", "pos", "stop")),
    ]


class Walk:
    """A model's layers as ``bevy_decode_run`` takes them.

    ``blocks[l]``: layer l's ``native.BlockWeights`` with its FFN norm, router and top-k
    (None where the native block does not take the layer: the walk stops before it);
    ``moe[l]``: layer l's FFN is its routed experts alone (no shared expert, not dense);
    ``table``: the (layer, expert) -> gate, up, down addresses and kernel type bits that
    the expert cache keeps (``n_layers * n_experts * 4`` uint64, gate 0 where the expert is
    not resident); ``inner``: the experts' width. ``stop``: another thread sets it to end
    a walk at the next layer (a request arrived or was aborted)."""

    def __init__(
        self,
        blocks: Sequence[native.BlockWeights | None],
        moe: Sequence[bool],
        table: ctypes.Array,
        n_experts: int,
        inner: int,
        stop: ctypes.c_int,
    ) -> None:
        self.blocks, self.moe = tuple(blocks), tuple(bool(m) for m in moe)
        L = len(self.blocks)
        first = next((b for b in self.blocks if b is not None), None)
        self.ok = (
            native.available()
            and first is not None
            and any(self.moe)
            and len(table) == L * n_experts * 4
            and all(b is None or (b.ok and b.topk is not None) for b in self.blocks)
        )
        if not self.ok:
            return
        self.L, self.E, self.inner = L, n_experts, inner
        self.heads, self.eps, self.interleaved = first.heads, first.eps, first.interleaved
        self.k, self.norm = first.topk
        layers, ints = (ctypes.c_uint64 * (5 * L))(), (_I * (4 * L))()
        for i, b in enumerate(self.blocks):
            ints[4 * i + 3] = int(self.moe[i])
            if b is None:
                continue
            if (b.heads, b.eps, b.interleaved, b.topk, b.E) != (
                self.heads,
                self.eps,
                self.interleaved,
                first.topk,
                n_experts,
            ):
                self.ok = False  # layers that differ in shape: not for one walk
                return
            layers[5 * i : 5 * i + 5] = [
                t.data_ptr() for t in (b.norm_w, b.wqkv, b.wo, b.ffn_w, b.router)
            ]
            ints[4 * i : 4 * i + 3] = [*b.codes, b.window]
        self._layers, self._ints, self._table, self._stop = layers, ints, table, stop

    def run(
        self,
        l0: int,
        h: torch.Tensor,
        x: torch.Tensor,
        ids: torch.Tensor,
        w: torch.Tensor,
        caches: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor] | None]],
        pos: Sequence[int],
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[int, torch.Tensor]:
        """Walk T rows on from before the MoE of layer ``l0``: h, x [T, D] float32, ids, w
        [T, K] (int64, float32), all contiguous, updated in place. ``caches[l][r]``: row
        r's (K, V) buffers of layer l, reserved for its position ``pos[r]``, for every
        layer after ``l0`` (None before), all float32 or all float16. ``rope``: (cos,
        sin) covering every position. Returns (the layer reached, trail): l < L, the rows
        stopped before that layer's MoE (``l0``: nothing ran), or L, h holding the last
        layer's output; trail [L, T, K] the routing of each layer entered after ``l0``."""
        lib = native.library()
        T, D = h.shape
        H, G, dh = self.heads
        L = self.L
        kb, vb, caps = (
            (ctypes.c_uint64 * (L * T))(),
            (ctypes.c_uint64 * (L * T))(),
            (_I * (L * T))(),
        )
        dtypes = set()
        for layer in range(l0 + 1, L):
            for r, (kbuf, vbuf) in enumerate(caches[layer]):
                kb[layer * T + r], vb[layer * T + r] = kbuf.data_ptr(), vbuf.data_ptr()
                caps[layer * T + r] = kbuf.shape[1]
                dtypes |= {kbuf.dtype, vbuf.dtype}
        if not dtypes <= {torch.float32} and dtypes != {torch.float16}:
            raise ValueError(f"native decode walk: KV buffers of {sorted(map(str, dtypes))}")
        cos, sin = rope
        positions = (_I * T)(*pos)
        args = DecodeArgs(
            T, D, L, self.k, self.E, H, G, dh, self.inner, self.interleaved, self.norm,
            int(dtypes == {torch.float16}), self.eps, dh**-0.5,
            ctypes.addressof(self._table), ctypes.addressof(self._layers),
            ctypes.addressof(self._ints), cos.data_ptr(), sin.data_ptr(),
            ctypes.addressof(kb), ctypes.addressof(vb), ctypes.addressof(caps),
            ctypes.addressof(positions), ctypes.addressof(self._stop),
        )  # fmt: skip
        trail = torch.empty(L, T, self.k, dtype=torch.int64)
        rc = lib.bevy_decode_run(
            ctypes.byref(args),
            l0,
            h.data_ptr(),
            x.data_ptr(),
            ids.data_ptr(),
            w.data_ptr(),
            trail.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == -1:
            raise MemoryError("native decode walk: out of memory")
        if rc < 0:
            raise ValueError("native decode walk: head counts, widths or top-k not taken")
        return rc, trail
