"""A routed expert's MLP computed straight from its quantized blocks (CPU, few rows).
``backend.kernels.dense`` uses the same graphs for dense weights.

Where the hand-written kernels of ``backend.kernels.native`` build (x86-64 with AVX2 and a
C compiler), ``expert_mlp`` runs them instead: fewer instructions per block, and nothing
to compile per shape. The graphs below are the fallback everywhere else.

Decoding tokens reach each expert one or two rows at a time. Dequantizing the whole
expert for them (three float32 matrices written and read back, ~10 MB for a demo
expert) costs several times the arithmetic. Here compiled (Inductor) graphs read the
Q4_1 / Q4_0 blocks and fold each block's scale into a dot product (gate and up in one
graph, then an eager SiLU, then down in another; see ``_graph``)::

    Q4_1: y[m, n] = sum_b (d[n, b] * q[n, b, :]) . x[m, b, :]  +  sum_b m[n, b] * sum(x[m, b, :])
    Q4_0: y[m, n] = sum_b (d[n, b] * (q[n, b, :] - 8)) . x[m, b, :]

The float32 sums run in another order than dequantize-then-matmul, so results agree to
float32 rounding (~1e-6 relative), not bit for bit. Each output row is reduced on its own
(the tests check that a row comes out the same alone and in a batch), so a request's
output does not depend on its batch-mates.

Each row count in ``ROW_BUCKETS`` has a graph of its own, with one reduction per row
over the same blocks: Inductor fuses them into one loop that unpacks each block once for
all rows (one graph for any row count would unpack them once per row). Other counts are
zero-padded to the next bucket. Above ``MAX_ROWS`` rows, an expert is dequantized once and
multiplied by BLAS instead. What these cost per demo expert is in ``docs/performance.md``.

Like ``fastquant`` it needs a C++ compiler at run time; ``BEVY_COMPILE=0`` or a failed
compile leaves callers on the dequantizing path (experts) or float32 BLAS (dense weights).
"""

from __future__ import annotations

import logging
import os
import threading

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType
from torch.fx.experimental.proxy_tensor import make_fx

from backend.kernels import native
from backend.kernels.quants import block_shape

log = logging.getLogger(__name__)

# Row counts with a graph of their own; other counts are zero-padded up to the next one.
ROW_BUCKETS = (1, 2, 4, 8)
MAX_ROWS = ROW_BUCKETS[-1]
# Distinct (block types, shape) kinds compiled per process (each is len(ROW_BUCKETS)
# graphs, compiled at engine start); experts of further kinds take the dequantizing path.
MAX_KINDS = 3
FUSABLE = (QType.Q4_0, QType.Q4_1)

# (raw block bytes, qtype, (rows, cols)) of gate, up, down
Part = tuple[torch.Tensor, QType, tuple[int, int]]


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 field at byte ``start`` of each block, as float32 [..., 1]. A dtype view,
    not a copy (``fastquant._f16`` copies): Inductor then reads the scales inside the dot
    product's loop instead of gathering them first.
    Needs an even byte offset, which every block's f16 field and every slot part has."""
    return blocks.view(torch.float16)[..., start // 2 : start // 2 + 1].to(torch.float32)


def _linear(x: torch.Tensor, raw: torch.Tensor, q4_1: bool, n: int, k: int) -> torch.Tensor:
    """x [M, k] @ W.T for W [n, k] stored as Q4_1 (20-byte) or Q4_0 (18-byte) blocks.

    M is static: the graph holds one reduction per row over the same blocks, which
    Inductor fuses into one loop that unpacks each block once for all rows."""
    nb = k // 32
    b = raw.view(n, nb, 20 if q4_1 else 18)
    qs = b[..., 4:] if q4_1 else b[..., 2:]  # [n, nb, 16]: low nibbles 0..15, high 16..31
    lo, hi = (qs & 0x0F).to(torch.float32), (qs >> 4).to(torch.float32)
    if not q4_1:
        lo, hi = lo - 8.0, hi - 8.0
    d = _f16(b, 0)  # [n, nb, 1]
    lo, hi = lo * d, hi * d
    rows = []
    for i in range(x.shape[0]):
        xb = x[i].view(nb, 2, 16)
        # One reduction over all of k (blocks x values): no horizontal sum per block.
        y = (lo * xb[:, 0] + hi * xb[:, 1]).sum((-1, -2))
        if q4_1:
            y = y + (_f16(b, 2)[..., 0] * xb.sum((-1, -2))).sum(-1)
        rows.append(y)
    return torch.stack(rows)  # [M, n]


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M <= MAX_ROWS, k] zero-padded to its row bucket, contiguous."""
    m = x.shape[0]
    if m not in ROW_BUCKETS:
        x = F.pad(x, (0, 0, 0, next(b for b in ROW_BUCKETS if b > m) - m))
    return x.contiguous()


class _Compiled:
    """``fn`` compiled by Inductor once per input shape, from the graph ``make_fx`` traces
    with fake tensors, and called directly: no Dynamo frame hook or guards per call.

    Through ``torch.compile`` every call would also run Dynamo's frame hook and guards
    (twice per expert: two graphs), a large share of a one-row expert's time, for the same
    bits. Shapes are the only key: callers pass contiguous float32 rows, padded to a
    bucket, and weights (slot parts, dense blocks) of one kind. Inductor's on-disk cache
    keeps later processes' compiles short."""

    compiles = 0  # in this process, all instances (the tests check warm-up covers calls)

    def __init__(self, fn) -> None:
        self.fn = fn
        self.by_shape: dict[tuple, object] = {}
        self.lock = threading.Lock()

    def __call__(self, *args: torch.Tensor):
        key = tuple(a.shape for a in args)
        compiled = self.by_shape.get(key)
        if compiled is None:
            with self.lock:
                compiled = self.by_shape.get(key)
                if compiled is None:
                    graph = make_fx(self.fn, tracing_mode="fake")(*args)
                    compiled = torch._inductor.compile(
                        graph, list(args), options={"cpp_wrapper": True}
                    )
                    self.by_shape[key] = compiled
                    _Compiled.compiles += 1
        return compiled(*args)


def _graph(kind: tuple[bool, bool, bool], inner: int, hidden: int):
    """down(silu(gate(x)) * up(x)) for one kind: two compiled graphs, with the SiLU run
    eagerly between them. Compiled into the down projection, the SiLU was fused one way
    for one row and another for several, and a row's result then depended on its
    batch-mates by float32 rounding (measured); with ATen's SiLU between the graphs it
    does not (tested bit for bit)."""

    def gate_up(x, gate, up):
        return _linear(x, gate, kind[0], inner, hidden), _linear(x, up, kind[1], inner, hidden)

    def down_proj(h, down):
        return _linear(h, down, kind[2], hidden, inner)

    gate_up, down_proj = _Compiled(gate_up), _Compiled(down_proj)

    def mlp(x, gate, up, down):
        g, u = gate_up(x, gate, up)
        return down_proj(F.silu(g) * u, down)

    return mlp


class _Fused:
    """Compiled graphs (see ``_graph``) per kind of expert (block types, shapes) and row bucket.
    Whether a kind can be fused is decided once, when it is first seen, so the
    per-expert call in the engine's job loop only looks the decision up.

    The graph runs under a C++ wrapper, which releases the GIL while it computes: the
    link thread then never waits for a kernel to finish before it can start the next read.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fns: dict[tuple, object | None] = {}  # kind -> compiled graph, or None: not fusable
        self.n_compiled = 0
        self.failed = os.environ.get("BEVY_COMPILE", "1") == "0"

    def _decide(self, kind: tuple):
        (qg, (inner, hidden), ng), (qu, su, nu), (qd, sd, nd) = kind
        fusable = (
            all(q in FUSABLE for q in (qg, qu, qd))
            and su == (inner, hidden)
            and sd == (hidden, inner)
            and hidden % 32 == 0
            and inner % 32 == 0
            and all(
                n == rows * cols // 32 * block_shape(q)[1]
                for q, (rows, cols), n in ((qg, (inner, hidden), ng), (qu, su, nu), (qd, sd, nd))
            )
        )
        if not fusable or self.n_compiled >= MAX_KINDS:
            return None
        self.n_compiled += 1
        return _graph((qg == QType.Q4_1, qu == QType.Q4_1, qd == QType.Q4_1), inner, hidden)

    def __call__(self, parts: tuple[Part, Part, Part], x: torch.Tensor) -> torch.Tensor | None:
        if self.failed or x.device.type != "cpu" or x.dtype != torch.float32:
            return None
        kind = tuple((q, shape, raw.numel()) for raw, q, shape in parts)
        fn = self.fns.get(kind, _UNSEEN)
        if fn is _UNSEEN:
            with self.lock:
                fn = self.fns.get(kind, _UNSEEN)
                if fn is _UNSEEN:
                    fn = self.fns[kind] = self._decide(kind)
        if fn is None or x.dim() != 2 or x.shape[1] != parts[0][2][1]:
            return None
        if any(raw.storage_offset() % 2 for raw, _, _ in parts):
            return None  # the scales' f16 view needs even offsets
        m = x.shape[0]
        try:
            # Always in inference mode, as the warm-up traced and compiled it.
            with torch.inference_mode():
                return fn(pad_rows(x), parts[0][0], parts[1][0], parts[2][0])[:m]
        except Exception as exc:  # no C++ compiler, an Inductor limitation: dequantize instead
            self.failed = True
            log.warning("fused quantized expert MLP unavailable, dequantizing: %s", exc)
            return None


_UNSEEN = object()
_FUSED = _Fused()


def expert_mlp(parts: tuple[Part, Part, Part], x: torch.Tensor) -> torch.Tensor | None:
    """down(silu(gate(x)) * up(x)) from quantized blocks, or None where the caller must
    dequantize (a block type without a fused kernel, too many rows, no compiler)."""
    if x.shape[0] > MAX_ROWS:
        return None
    out = native.expert_mlp(parts, x)  # the hand-written kernel, where it builds
    return _FUSED(parts, x) if out is None else out


def compiled_mlp(parts: tuple[Part, Part, Part], x: torch.Tensor) -> torch.Tensor | None:
    """``expert_mlp`` by the compiled graphs alone (the engine's ``compiled`` expert
    backend), or None where they do not take these arguments."""
    return None if x.shape[0] > MAX_ROWS else _FUSED(parts, x)


@torch.inference_mode()
def warm_up(parts: tuple[Part, Part, Part]) -> bool:
    """Compile the graphs for every row bucket ahead, in inference mode as the engine
    runs, so no request waits for it. True if they are ready."""
    hidden = parts[0][2][1]
    return all(compiled_mlp(parts, torch.zeros(rows, hidden)) is not None for rows in ROW_BUCKETS)
