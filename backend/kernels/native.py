"""Hand-written CPU kernels for products with Q4_0 / Q4_1 / Q5_0 / Q3_K / Q4_K / Q5_K /
Q6_K / Q8_0 / IQ4_XS weights and for decoding attention, in C: ``q4_matmul.c`` (the
products, one expert, a MoE layer's experts), ``attention.c`` (decoding attention and
the attention block), ``decode.c`` (a decoding group's walk through the layers over those
two; ``decode.py``) and the headers they include (``simd.h``: vector helpers;
``kernels.h``: the exported functions, whose signatures are the ctypes argtypes set
below). They are compiled together into one library with the system C compiler on first
use and cached per machine. What they were measured to take is in
``docs/performance.md``; this states what they compute and why they are built so.

Decoding multiplies one to eight rows by each weight, so the time goes to widening the
4-bit weights, not to arithmetic on the rows. The Inductor graphs of ``qmatmul`` widen
each block once for all rows too, but the kernel below does it with fewer instructions
(AVX2 or AVX-512) and runs a whole expert (gate, up, SiLU, down) in one call, with no
Python between its steps. The kernel is compiled once per row count (1-8) so that its
accumulators stay in registers. Each kernel also prefetches the weight rows it reads
next: R rows of a few hundred bytes read side by side are short streams the hardware
prefetcher does not pick up in time when the experts' bytes are in memory, not in the
CPU's cache (as the engine's slots hold them). Neither changes a result's bits.

It needs a C compiler with OpenMP (``cc``, or ``$CC``) and an x86-64 CPU with AVX2, FMA and
F16C; elsewhere, or if the build fails, ``available()`` is False and callers keep
their compiled graphs. ``BEVY_NATIVE=0`` (or ``BEVY_COMPILE=0``) turns it off. The
library is built with ``-march=native`` into the cache directory under a name that
hashes every source and header, the flags, the compiler and the CPU (model and feature
flags on Linux; elsewhere only the platform's description of the processor), so an edit
to any of them builds it again. It runs on as many threads as torch's intra-op setting of
the calling thread.

``moe`` runs all of a job's experts in one call (the engine's ``native`` expert backend, ``backend/engine/experts/native.py``),
without the Python and torch ops per expert that calling ``expert_mlp`` for each costs.
With at least two experts per thread, the threads take whole experts in turn (one
parallel region per call instead of three barriers per expert), and the products are
added in order after.

Results agree with dequantize-then-matmul to float32 rounding (~1e-6 relative), like
the graphs; each row is reduced on its own, so a row's result is the same alone and in
a batch (the tests check both).

``attention`` and ``attention_block`` run a decoding step's attention (one new token per
sequence, float32 or float16 KV cache, ``Transformer.kv_dtype``): the block
also takes the norm, the q/k/v and output projections from their stored blocks, RoPE and
the residual, then the FFN's norm and the router's logits, softmax and top-k, one call
per layer instead of ~30 torch ops. Positions go in chunks of 256 whose partial
softmaxes are merged in order, so a row's result depends neither on its batch-mates nor
on the thread count; they agree with a float64 reference on the same keys and values
to ~1e-6 (exp by a polynomial within ~2 ulp).
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as QType

from backend.paths import cache_dir

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
# The C files compiled together into the one library, and the headers they include (which
# go into the build's key too: an edit to a header builds the library again).
SOURCES = ("q4_matmul.c", "attention.c", "decode.c")
HEADERS = ("simd.h", "kernels.h")
# Files here that build a library of their own: the link's loop (``link.py``).
NOT_KERNELS = ("link.c", "link.h")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_BLOCK_BYTES = {QType.Q4_0: 18, QType.Q4_1: 20}
# The types ``pack`` takes, by their code for the C side's ``bevy_q4_pack``.
_PACKS = {QType.Q4_0: 0, QType.Q4_1: 1}
# The attention block and ``linear`` also take Q8_0 (most GGUF files' LM head): f16 d and
# 32 int8.
_LINEAR_BLOCK_BYTES = {**_BLOCK_BYTES, QType.Q8_0: 34}
# The block types the expert kernels (and ``linear``) read: (weights per block, bytes per
# block, the C side's type code). A row's width must be a multiple of its block's.
EXPERT_TYPES = {
    QType.Q4_0: (32, 18, 0),
    QType.Q4_1: (32, 20, 1),
    QType.Q4_K: (256, 144, 2),
    QType.Q6_K: (256, 210, 3),
    QType.Q5_K: (256, 176, 4),
    QType.Q8_0: (32, 34, 5),
    QType.Q3_K: (256, 110, 6),
    QType.IQ4_XS: (256, 136, 7),
    QType.Q5_0: (32, 22, 8),
}
# Q4_0 / Q4_1 packed by 16 rows (``pack``): the C side's code for each stored type's code.
PACKED_CODES = {0: 9, 1: 10}
# The block types whose expert products read x rounded to 8 bits per block of 32
# (``x8_round``), as stored or packed alike (the same bits either way): their kernel
# takes any number of rows, so that a row's result does not depend on its batch.
ROUNDING = (QType.Q4_0, QType.Q4_1)
# The expert kernels' activations (``ModelConfig.native_act``) and their bit in ``types``.
ACTS = {"silu": 0, "gelu": 1 << 12}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


class UnsupportedCPU(OSError):
    """The kernels are not written for this processor (expected there: not a warning)."""


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and feature flags where the OS
    lists them (Linux), else the platform's description."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.platform()


def sources(where: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(C files to compile, headers they include): this package's ``SOURCES`` and
    ``HEADERS``, or another tree's for an A/B (``benchmarks/q4_kernels.py --against``):
    ``where``'s ``*.c`` and ``*.h`` if it is a directory, else ``where`` alone (one C file
    holding them all, as ``native_q4.c`` did before the sources were split)."""
    if where is None:
        return [HERE / n for n in SOURCES], [HERE / n for n in HEADERS]
    if where.is_dir():
        found = (
            sorted(p for p in where.glob("*.c") if p.name not in NOT_KERNELS),
            sorted(p for p in where.glob("*.h") if p.name not in NOT_KERNELS),
        )
        if not found[0]:
            raise OSError(f"no C sources in {where}")
        return found
    return [where], []


def build_key(files: list[Path], flags: tuple[str, ...], cc: str) -> str:
    """The cached library's name: every file by name and bytes (renaming one, moving code
    between them or editing a header gives another key), the flags, the compiler, the CPU."""
    parts = [p.name.encode() + b"\0" + p.read_bytes() for p in files]
    return hashlib.sha256(
        b"\0".join([*parts, " ".join(flags).encode(), cc.encode(), _cpu_id().encode()])
    ).hexdigest()[:20]


def compiled(
    stem: str, srcs: list[Path], headers: list[Path], flags: tuple[str, ...], out_dir: Path | None
) -> ctypes.CDLL:
    """Compile ``srcs`` with the system C compiler (``$CC``, else ``cc``) into one shared
    library, or reuse its cached build (``out_dir``, else the cache directory's
    ``kernels``, under a name from ``build_key``), and load it. Raises OSError on failure."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc) found")
    key = build_key([*srcs, *headers], flags, cc)
    out_dir = out_dir or cache_dir() / "kernels"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}-{key}.so"
    if not path.exists():
        # Build beside the target and rename: another process never loads half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            done = subprocess.run(
                [cc, *flags, "-o", tmp, *map(str, srcs), "-lm"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if done.returncode != 0:
                raise OSError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(path))  # a CDLL call releases the GIL while it runs
    except OSError:
        path.unlink(missing_ok=True)  # a damaged cache entry: built again next time
        raise


def build(
    out_dir: Path | None = None, extra_flags: tuple[str, ...] = (), source: Path | None = None
) -> ctypes.CDLL:
    """Compile (or reuse the cached build of) the kernels and load them. Raises on failure.
    ``source``: another tree's kernels instead of this package's (see ``sources``)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise UnsupportedCPU(f"they are written for x86-64, not {platform.machine()}")
    lib = compiled("native_q4", *sources(source), (*FLAGS, *extra_flags), out_dir)
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.bevy_q4_linear.argtypes = [ptr, i32, ptr, ptr, i32, i32, i32, i32]
    lib.bevy_q4_linear.restype = i32
    lib.bevy_q4_expert_mlp.argtypes = [ptr, ptr, ptr, i32, ptr, ptr, i32, i32, i32, i32]
    lib.bevy_q4_expert_mlp.restype = i32
    lib.bevy_q4_moe.argtypes = [
        ptr,
        ptr,
        ptr,
        i32,
        ptr,
        ptr,
        i32,
        ptr,
        ptr,
        ptr,
        i32,
        i32,
        i32,
        i32,
    ]
    lib.bevy_q4_moe.restype = i32
    lib.bevy_q8_linear.argtypes = [ptr, ptr, ptr, i32, i32, i32, i32]
    lib.bevy_q8_linear.restype = i32
    lib.bevy_f32_linear.argtypes = [ptr, ptr, ptr, i32, i32, i32, i32]
    lib.bevy_f32_linear.restype = i32
    lib.bevy_q4_pack.argtypes = [ptr, i32, i32, i32, i32]
    lib.bevy_q4_pack.restype = i32
    lib.bevy_q4_unpack.argtypes = [ptr, ptr, i32, i32, i32]
    lib.bevy_q4_unpack.restype = i32
    f32 = ctypes.c_float
    lib.bevy_attn_decode.argtypes = [ptr, i32, ptr, i32, ptr, i32, ptr, ptr, ptr, ptr]
    lib.bevy_attn_decode.argtypes += [i32, i32, i32, i32, f32, i32, i32, ptr, i32]
    lib.bevy_attn_decode.restype = i32
    lib.bevy_attn_block.argtypes = [ptr, i32, i32, ptr, f32, ptr, i32, ptr, i32, ptr, ptr, i32]
    lib.bevy_attn_block.argtypes += [ptr, ptr, ptr, ptr, i32, i32, i32, f32, i32, i32, ptr]
    lib.bevy_attn_block.argtypes += [ptr, ptr, ptr, i32, ptr, i32, i32, ptr, ptr, i32]
    lib.bevy_attn_block.restype = i32
    lib.bevy_decode_run.argtypes = [ptr, i32, ptr, ptr, ptr, ptr, ptr, i32]
    lib.bevy_decode_run.restype = i32
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first call; None where they cannot be (logged once)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("BEVY_NATIVE", "1") == "0" or os.environ.get("BEVY_COMPILE") == "0":
                log.info("native Q4 kernels turned off by the environment")
            else:
                try:
                    _lib = build()
                except UnsupportedCPU as exc:
                    log.info("native Q4 kernels not used: %s", exc)
                except Exception as exc:  # no compiler, no OpenMP, a sandbox: graphs instead
                    log.warning(
                        "native Q4 kernels unavailable (%s); quantized products use the "
                        "slower compiled graphs",
                        exc,
                    )
            _tried = True
    return _lib


def available() -> bool:
    return library() is not None


def _rows_ok(x: torch.Tensor, k: int) -> bool:
    return (
        x.dim() == 2
        and x.shape[1] == k
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.is_contiguous()
    )


def _weight_ok(raw: torch.Tensor, bb: int | None, n: int, k: int) -> bool:
    """``raw`` holds a weight [n, k] of ``bb``-byte blocks of 32, where the kernels read it
    (``bb`` 0: any block size, checked by the caller)."""
    return (
        bb is not None
        and k % 32 == 0
        and raw.dtype == torch.uint8
        and raw.device.type == "cpu"
        and raw.is_contiguous()
        and (bb == 0 or raw.numel() == n * (k // 32) * bb)
    )


def linear(
    raw: torch.Tensor, qtype: QType, shape: tuple[int, int], x: torch.Tensor, packed: bool = False
):
    """x [M, k] @ W.T for W [n, k] = ``shape`` stored in ``raw``'s blocks (a type of
    ``EXPERT_TYPES``; ``packed`` where ``pack`` packed them), or ``raw`` itself for F32;
    None where the kernels are unavailable or do not take these arguments. Each row of x
    is reduced on its own: a row's result does not depend on its batch-mates."""
    lib = library()
    n, k = shape
    if qtype == QType.F32:
        ok = (
            raw.dtype == torch.float32
            and raw.device.type == "cpu"
            and raw.is_contiguous()
            and tuple(raw.shape) == (n, k)
        )
        code = None
    elif qtype in EXPERT_TYPES:
        width, bb, code = EXPERT_TYPES[qtype]
        code = PACKED_CODES[code] if packed else code
        ok = k % width == 0 and _weight_ok(raw, 0, n, k) and raw.numel() == n * k // width * bb
    else:
        code, ok = None, _weight_ok(raw, _LINEAR_BLOCK_BYTES.get(qtype), n, k)
    if lib is None or not ok:
        return None
    x = x.contiguous()
    if not _rows_ok(x, k):
        return None
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    if x.shape[0] and qtype == QType.F32:
        lib.bevy_f32_linear(
            raw.data_ptr(), x.data_ptr(), y.data_ptr(), x.shape[0], n, k, torch.get_num_threads()
        )
    elif x.shape[0] and qtype == QType.Q8_0:
        lib.bevy_q8_linear(
            raw.data_ptr(), x.data_ptr(), y.data_ptr(), x.shape[0], n, k, torch.get_num_threads()
        )
    elif x.shape[0]:
        rc = lib.bevy_q4_linear(
            raw.data_ptr(),
            code,
            x.data_ptr(),
            y.data_ptr(),
            x.shape[0],
            n,
            k,
            torch.get_num_threads(),
        )
        if rc:
            raise MemoryError("native Q4 linear: out of memory")
    return y


def pack(raw: torch.Tensor, qtype: QType, shape: tuple[int, int]) -> bool:
    """Reorder a Q4_0 / Q4_1 weight [n, k] stored in ``raw`` in place, 16 rows to a group
    (the groups shared out on torch's threads), for the packed kernels (``q4p_cols`` in
    q4_matmul.c: integer products with x rounded to 8 bits per block of 32, as ggml's CPU
    kernels multiply; ``expert_mlp`` gives the same bits on the blocks as stored, more
    slowly, while ``linear`` multiplies those in float). False, with ``raw`` untouched,
    where the kernels are unavailable or the weight does not pack (another type, n not a
    multiple of 16).
    The caller then passes ``packed`` to ``expert_mlp`` / ``packed_types`` / ``linear``,
    and ``unpack`` gives the blocks as stored back."""
    lib = library()
    n, k = shape
    code = _PACKS.get(qtype)
    if lib is None or code is None or not _weight_ok(raw, _BLOCK_BYTES[qtype], n, k):
        return False
    return lib.bevy_q4_pack(raw.data_ptr(), code, n, k, torch.get_num_threads()) >= 0


def unpack(raw: torch.Tensor, qtype: QType, shape: tuple[int, int]) -> torch.Tensor:
    """The blocks as stored of a weight that ``pack`` packed (a new tensor)."""
    lib = library()
    n, k = shape
    out = torch.empty_like(raw)
    if lib is None or lib.bevy_q4_unpack(raw.data_ptr(), out.data_ptr(), _PACKS[qtype], n, k):
        raise ValueError(f"not a packed {qtype.name} weight of shape {shape}")
    return out


def packed_types(types: int, packed: tuple[bool, ...]) -> int:
    """``types`` (``mlp_types``' bits) with part i's code the packed one where
    ``packed[i]``."""
    for i, p in enumerate(packed):
        if p:
            code = (types >> (4 * i)) & 15
            types = types & ~(15 << (4 * i)) | PACKED_CODES[code] << (4 * i)
    return types


def expert_mlp(
    parts: tuple, x: torch.Tensor, act: str = "silu", packed: tuple[bool, ...] = (False,) * 3
):
    """down(act(gate(x)) * up(x)) for ``parts`` = ((raw, qtype, shape) of gate, up, down),
    ``act`` SiLU or GELU (tanh), ``packed[i]`` where part i's bytes were packed (``pack``);
    None where the kernels are unavailable or do not take these arguments. Q4_0 / Q4_1
    parts read their input rounded to 8 bits per block of 32 (``ROUNDING``), packed or
    not; each row's result does not depend on its batch-mates."""
    lib = library()
    if lib is None:
        return None
    types = mlp_types(tuple((q, shape, raw.numel()) for raw, q, shape in parts), act)
    if types is not None:
        types = packed_types(types, packed)
    if types is None or not all(
        raw.dtype == torch.uint8 and raw.device.type == "cpu" and raw.is_contiguous()
        for raw, _, _ in parts
    ):
        return None
    (g, _, (inner, hidden)), (u, _, _), (d, _, _) = parts
    x = x.contiguous()
    if not _rows_ok(x, hidden):
        return None
    out = torch.empty(x.shape[0], hidden, dtype=torch.float32)
    if x.shape[0]:
        rc = lib.bevy_q4_expert_mlp(
            g.data_ptr(),
            u.data_ptr(),
            d.data_ptr(),
            types,
            x.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            inner,
            hidden,
            torch.get_num_threads(),
        )
        if rc:
            raise MemoryError("native Q4 expert MLP: out of memory")
    return out


def mlp_types(parts: tuple, act: str = "silu") -> int | None:
    """The kernels' ``types`` bits for an expert whose parts are ((qtype, (rows, cols),
    nbytes) of gate, up, down) and whose activation is ``act`` (SiLU or GELU), or None if
    they do not take it (block types, shapes, sizes)."""
    if act not in ACTS:
        return None
    (gq, gs, gn), (uq, us, un), (dq, ds, dn) = parts
    kinds = [EXPERT_TYPES.get(q) for q in (gq, uq, dq)]
    if None in kinds or len(gs) != 2:
        return None
    inner, hidden = gs
    if tuple(us) != (inner, hidden) or tuple(ds) != (hidden, inner):
        return None
    codes = 0
    for i, ((width, bb, code), cols, nbytes) in enumerate(
        zip(kinds, (hidden, hidden, inner), (gn, un, dn), strict=True)
    ):
        if inner % 32 or hidden % 32 or cols % width or nbytes != inner * hidden // width * bb:
            return None
        codes |= code << (4 * i)
    return codes | ACTS[act]


def moe(
    weights: list[int],
    types: list[int],
    counts: list[int],
    routes: list[int],
    x: torch.Tensor,
    route_w: torch.Tensor,
    inner: int,
    hidden: int,
    sum_rows: int | None = None,
    into: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A MoE layer's routed experts for rows ``x`` [R, hidden] in one call. None where the
    kernels are unavailable or do not take these arguments.

    For expert j: ``weights[3j:3j+3]`` are the addresses of its gate, up and down blocks,
    which the caller keeps alive and has checked (``mlp_types`` gives ``types[j]``); its
    ``counts[j]`` routes are the next entries of ``routes``, each an index i into
    ``route_w`` [R, K] (row i // K), rows ascending. Returns (y, parts):

    - y [sum_rows, hidden]: for the first ``sum_rows`` rows (default all), the sum of their
      routes' route_w * expert(x), added in the order given;
    - parts [len(routes), hidden] if some rows are past ``sum_rows``, else [0, hidden]:
      route_w * expert(x) of each route of those rows, at the route's place in
      ``routes`` (the entries of the other routes are not written).

    Every value is the same bits as running each expert alone on its rows
    (``expert_mlp``), scaling by the weight and adding in this order.

    ``into``: sums to add to instead of zeros ([sum_rows, hidden] float32, contiguous; it
    becomes y): rows that had earlier experts added, in expert order, continue where
    they were, as adding this call's products to them one by one would."""
    lib = library()
    if lib is None or not _rows_ok(x, hidden) or route_w.dtype != torch.float32:
        return None
    route_w = route_w.contiguous()
    if route_w.dim() != 2 or route_w.shape[0] != x.shape[0] or route_w.device.type != "cpu":
        return None
    k, n = route_w.shape[1], route_w.numel()
    sum_rows = x.shape[0] if sum_rows is None else sum_rows
    if (
        len(weights) != 3 * len(types)
        or len(counts) != len(types)
        or sum(counts) != len(routes)
        or (routes and not 0 <= min(routes) <= max(routes) < n)
        or not 0 <= sum_rows <= x.shape[0]
    ):
        raise ValueError("native MoE: experts, counts, routes and rows do not agree")
    if into is None:
        y = torch.zeros(sum_rows, hidden, dtype=torch.float32)
    elif (
        into.shape != (sum_rows, hidden)
        or into.dtype != torch.float32
        or into.device.type != "cpu"
        or not into.is_contiguous()
    ):
        raise ValueError("native MoE: the sums to add to are not [sum_rows, hidden] float32")
    else:
        y = into
    parts = torch.empty(len(routes) if sum_rows < x.shape[0] else 0, hidden, dtype=torch.float32)
    if routes:
        # array.array takes each list whole; a ctypes array converts it item by item
        args = array.array("Q", weights), array.array("i", types), array.array("i", counts)
        at = array.array("i", routes)
        rc = lib.bevy_q4_moe(
            args[0].buffer_info()[0],
            args[1].buffer_info()[0],
            args[2].buffer_info()[0],
            len(types),
            at.buffer_info()[0],
            route_w.data_ptr(),
            k,
            x.data_ptr(),
            y.data_ptr(),
            parts.data_ptr() if parts.numel() else None,
            sum_rows,
            inner,
            hidden,
            torch.get_num_threads(),
        )
        if rc:
            raise MemoryError("native Q4 MoE: out of memory")
    return y, parts


# Rows of one expert up to which ``expert_mlp`` (eight rows at a time, the weights read
# from their blocks for each eight) beats dequantizing the expert and multiplying by BLAS,
# measured with the experts out of the CPU's cache (docs/performance.md). Past it, an
# expert is dequantized once for all its rows, unless ``any_rows``.
EXPERT_MAX_ROWS = 128


def any_rows(qtypes) -> bool:
    """Whether the expert kernels take any number of rows for an expert whose parts have
    these block types: where one part reads x rounded (``ROUNDING``), whose products
    dequantize-then-matmul would not reproduce; its kernel, from a packed copy for many
    rows, also beats BLAS at every row count measured (docs/performance.md)."""
    return any(q in ROUNDING for q in qtypes)


# ``attention``: the most query heads per kv head the kernel takes (``ATT_MAX_REP``).
ATTN_MAX_REP = 16


def _heads_ok(t: torch.Tensor, rows: int, heads: int, dh: int) -> bool:
    """t [rows, heads, dh] float32 on the CPU, each row's heads side by side."""
    return (
        t.dim() == 3
        and tuple(t.shape) == (rows, heads, dh)
        and t.dtype == torch.float32
        and t.device.type == "cpu"
        and t.stride(2) == 1
        and t.stride(1) == dh
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    pos: list[int],
    scale: float,
    window: int = 0,
) -> torch.Tensor | None:
    """Decoding attention for T sequences with one new token each, in one call.

    q [T, H, dh] (RoPE applied), k, v [T, G, dh] the new keys and values; ``caches[r]``
    = (K, V) [G, cap, dh] buffers of sequence r (float32, or float16: every buffer the
    same), with ``pos[r]`` < cap, holding its keys and values at positions before
    ``pos[r]``. Writes row r's key and value at ``pos[r]`` (into float16 buffers rounded
    as torch rounds), then returns out [T, H * dh]: per head, softmax(q . K[:pos+1] *
    scale) V[:pos+1], query head h reading kv head h // (H / G); with a sliding ``window``
    > 0, over the last ``window`` positions only. Each row is computed on its own, in
    chunks of positions merged in order: its result does not depend on its batch-mates or
    on the number of threads. None where the kernels are unavailable or do not take
    these arguments (the caller's buffers are then untouched)."""
    lib = library()
    if lib is None or q.dim() != 3 or k.dim() != 3:
        return None
    (T, H, dh), G = q.shape, k.shape[1]
    if not (
        _caches_ok(caches, pos, T, H, G, dh)
        and _heads_ok(q, T, H, dh)
        and _heads_ok(k, T, G, dh)
        and _heads_ok(v, T, G, dh)
    ):
        return None
    out = torch.empty(T, H * dh, dtype=torch.float32)
    if T:
        rc = lib.bevy_attn_decode(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            *_cache_args(caches, pos),
            T,
            H,
            G,
            dh,
            scale,
            window,
            kv_half(caches),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        _check(rc, "native attention")
    return out


def _check(rc: int, what: str) -> None:
    """The attention kernels' return codes: -1 out of memory, -2 heads (or a top-k) they
    do not take (the checks above refuse those first)."""
    if rc == -1:
        raise MemoryError(f"{what}: out of memory")
    if rc:
        raise ValueError(f"{what}: head counts, widths or top-k not taken")


def _caches_ok(caches: list, pos: list[int], T: int, H: int, G: int, dh: int) -> bool:
    """Head counts and widths the attention kernel takes, and for each of T rows a cache
    (K, V) [G, cap, dh] of CPU buffers with room at its position, all float32 or all
    float16; no two rows writing one sequence's cache."""
    if (
        G == 0
        or H % G
        or H // G > ATTN_MAX_REP
        or dh % 16
        or dh > 256
        or len(caches) != T
        or len(pos) != T
    ):
        return False
    for (kb, vb), p in zip(caches, pos, strict=True):
        if not (
            kb.dim() == 3
            and kb.shape[0] == G
            and kb.shape[2] == dh
            and 0 <= p < kb.shape[1]
            and vb.shape == kb.shape
            and kb.dtype == vb.dtype == caches[0][0].dtype
            and kb.dtype in (torch.float32, torch.float16)
            and kb.device.type == vb.device.type == "cpu"
            and kb.is_contiguous()
            and vb.is_contiguous()
        ):
            return False
    # Every buffer distinct: no row's write lands in another's keys or its own values.
    return len({t.data_ptr() for pair in caches for t in pair}) == 2 * T


def kv_half(caches: list) -> int:
    """The kernels' ``kv_half``: 1 where the (K, V) buffers hold float16 (``_caches_ok``
    takes only caches of one dtype), 0 for float32 or no rows."""
    return int(bool(caches) and caches[0][0].dtype == torch.float16)


def _cache_args(caches: list, pos: list[int]) -> tuple:
    """The kernels' kbuf, vbuf, caps and pos arrays."""
    u64, i32 = ctypes.c_uint64 * len(caches), ctypes.c_int * len(caches)
    return (
        u64(*(kb.data_ptr() for kb, _ in caches)),
        u64(*(vb.data_ptr() for _, vb in caches)),
        i32(*(kb.shape[1] for kb, _ in caches)),
        i32(*pos),
    )


# ``attention_block``: the largest router (experts x hidden) it computes the logits of.
ROUTER_MAX = 1 << 17

# The attention block's weight types: the kernels' codes.
_BLOCK_CODES = {QType.Q4_0: 0, QType.Q4_1: 1, QType.Q8_0: 2}


def _vector_ok(t: torch.Tensor, D: int) -> bool:
    return (
        t.shape == (D,)
        and t.dtype == torch.float32
        and t.device.type == "cpu"
        and t.is_contiguous()
    )


class BlockWeights:
    """A layer's weights and shapes for ``attention_block``, checked once: ``ok`` says
    whether the kernels take them.

    ``qkv`` = (blocks, type) of q, k and v's weights stacked [(H + 2G) * dh, D], ``o`` of
    the output projection [D, H * dh] (Q4_0, Q4_1 or Q8_0, no biases); ``heads`` = (H, G,
    dh); ``interleaved``: RoPE rotates adjacent pairs (GGUF llama), else halves. ``ffn`` =
    (the FFN's norm weight [D], a float32 router [E, D] or None), ``topk`` = (k, whether
    the k weights are normalized to sum to 1) or None: see ``attention_block``. The router
    is dropped (``router`` None) unless D is a multiple of 16 and E * D <= ``ROUTER_MAX``,
    and ``topk`` unless a router is kept and 0 < k <= E. ``window``: the layer's sliding
    window (0: none), as in ``attention``."""

    def __init__(
        self,
        norm_w: torch.Tensor,
        eps: float,
        qkv: tuple[torch.Tensor, QType],
        o: tuple[torch.Tensor, QType],
        heads: tuple[int, int, int],
        interleaved: bool,
        ffn: tuple[torch.Tensor, torch.Tensor | None] | None = None,
        topk: tuple[int, bool] | None = None,
        window: int = 0,
    ) -> None:
        (H, G, dh), (wqkv, tq), (wo, to) = heads, qkv, o
        self.window = window
        ffn_w, router = ffn if ffn is not None else (None, None)
        D = norm_w.shape[0] if norm_w.dim() == 1 else -1
        if router is not None and not (
            ffn_w is not None
            and D % 16 == 0
            # One thread, one dot product after another: for routers up to this size (the
            # demo's is 32 x 576), where BLAS's threads would cost more than they save. By
            # the model's shape only, so that a row's logits do not depend on its batch.
            and router.numel() <= ROUTER_MAX
            and router.dim() == 2
            and router.shape[1] == D
            and router.dtype == torch.float32
            and router.device.type == "cpu"
            and router.is_contiguous()
        ):
            router = None
        if router is None or topk is None or not 0 < topk[0] <= router.shape[0]:
            topk = None
        self.norm_w, self.eps, self.heads, self.interleaved = norm_w, eps, heads, interleaved
        self.wqkv, self.wo, self.ffn_w, self.router, self.topk = wqkv, wo, ffn_w, router, topk
        self.D, self.E = D, 0 if router is None else router.shape[0]
        self.codes = (_BLOCK_CODES.get(tq), _BLOCK_CODES.get(to))
        self.ok = (
            D > 0
            and G > 0
            and _weight_ok(wqkv, _LINEAR_BLOCK_BYTES.get(tq), (H + 2 * G) * dh, D)
            and _weight_ok(wo, _LINEAR_BLOCK_BYTES.get(to), D, H * dh)
            and _vector_ok(norm_w, D)
            and (ffn_w is None or _vector_ok(ffn_w, D))
        )


def attention_block(
    h: torch.Tensor,
    blk: BlockWeights,
    rope: tuple[torch.Tensor, torch.Tensor],
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    pos: list[int],
) -> tuple[torch.Tensor, ...] | None:
    """A decoding step's attention block in one call, for T sequences with one new token
    each: (h + attention(rms_norm(h) * norm_w) @ Wo.T [T, D], x, logits, ids, weights).

    ``blk``: the layer's weights (``BlockWeights``); ``rope`` = (cos, sin) tables [P, dh /
    2] by position. Writes each row's key and value at its position as ``attention`` does,
    with which it shares the attention itself. With ``blk.ffn_w``, x [T, D] is the block's
    output RMS-normed with it (eps as above), else None; with ``blk.router``, logits [T, E]
    its router logits, else None; with ``blk.topk`` = (k, norm) too, ids [T, k] (int64)
    and weights [T, k] its routing: the k largest logits (largest first; of equal ones,
    the lower expert), weighted by the softmax over all E (divided by their sum if norm),
    else None. Each row is computed on its own. None where the kernels are unavailable or
    do not take these arguments."""
    lib = library()
    (H, G, dh), (cos, sin) = blk.heads, rope
    D = blk.D
    if lib is None or not blk.ok or not _rows_ok(h, D):
        return None
    T = h.shape[0]
    if not (
        _caches_ok(caches, pos, T, H, G, dh)
        and all(
            t.dtype == torch.float32
            and t.device.type == "cpu"
            and t.is_contiguous()
            and t.dim() == 2
            and t.shape[1] == dh // 2
            and t.shape[0] > max(pos, default=0)
            for t in (cos, sin)
        )
    ):
        return None
    out = torch.empty(T, D, dtype=torch.float32)
    x = None if blk.ffn_w is None else torch.empty(T, D, dtype=torch.float32)
    E, router = blk.E, blk.router
    logits = None if router is None else torch.empty(T, E, dtype=torch.float32)
    k, norm = blk.topk or (0, False)
    ids = None if not k else torch.empty(T, k, dtype=torch.int64)
    weights = None if not k else torch.empty(T, k, dtype=torch.float32)
    if T:
        rc = lib.bevy_attn_block(
            h.data_ptr(),
            T,
            D,
            blk.norm_w.data_ptr(),
            blk.eps,
            blk.wqkv.data_ptr(),
            blk.codes[0],
            blk.wo.data_ptr(),
            blk.codes[1],
            cos.data_ptr(),
            sin.data_ptr(),
            blk.interleaved,
            *_cache_args(caches, pos),
            H,
            G,
            dh,
            dh**-0.5,
            blk.window,
            kv_half(caches),
            out.data_ptr(),
            None if x is None else blk.ffn_w.data_ptr(),
            None if x is None else x.data_ptr(),
            None if logits is None else router.data_ptr(),
            E,
            None if logits is None else logits.data_ptr(),
            k,
            norm,
            None if ids is None else ids.data_ptr(),
            None if weights is None else weights.data_ptr(),
            torch.get_num_threads(),
        )
        _check(rc, "native attention block")
    return out, x, logits, ids, weights
