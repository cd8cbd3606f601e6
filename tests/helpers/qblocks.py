"""Random quantized blocks with sane scales, for kernel tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.kernels.quants import QType, block_shape, dequantize

HIDDEN, INNER = 64, 96


def random_blocks(qtype: QType, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random blocks of a weight [rows, cols] with f16 scales of a sane size (Q6_K's and
    Q3_K's super-block scale is its last 2 bytes; the others' lead their block)."""
    g = torch.Generator().manual_seed(seed)
    width, bb = block_shape(qtype)
    n = rows * cols // width
    raw = torch.randint(0, 256, (n, bb), dtype=torch.uint8, generator=g)
    n_scales = 2 if qtype in (QType.Q4_1, QType.Q4_K, QType.Q5_K) else 1
    size = 0.002 if width == 256 else 0.05  # (K-quants multiply by sub-block scales too)
    scales = (torch.randn((n, n_scales), generator=g) * size).half()
    at = bb - 2 if qtype in (QType.Q6_K, QType.Q3_K) else 0
    raw[:, at : at + 2 * n_scales] = scales.view(torch.uint8).view(n, 2 * n_scales)
    return raw.reshape(-1)


def rounded_8bit(x: torch.Tensor) -> torch.Tensor:
    """x as the packed kernels read it (``x8_round`` in q4_matmul.c), written out in torch:
    each block of 32 of a row times 127 / its largest magnitude, rounded to the nearest
    integer (ties to even), times that magnitude / 127. The same float operations, so the
    same integers."""
    b = x.reshape(*x.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(b * inv) * (amax / 127.0)).reshape(x.shape)


# The block types whose native expert products read their input rounded to 8 bits
# (``x8_round``), packed or as stored.
ROUNDING = (QType.Q4_0, QType.Q4_1)


def expert_reference(parts: tuple, x: torch.Tensor, rounded: bool = True) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for ``parts`` ((raw, qtype, shape) of gate, up, down)
    dequantized, in torch; with ``rounded``, each Q4_0 / Q4_1 part's input rounded as the
    native kernels read it (``rounded_8bit``)."""
    (g, gq, gs), (u, uq, us), (d, dq, ds) = parts

    def read(t: torch.Tensor, q: QType) -> torch.Tensor:
        return rounded_8bit(t) if rounded and q in ROUNDING else t

    h = F.silu(F.linear(read(x, gq), dequantize(g, gq, gs)))
    h = h * F.linear(read(x, uq), dequantize(u, uq, us))
    return F.linear(read(h, dq), dequantize(d, dq, ds))


def random_expert(qtypes: tuple[QType, QType, QType], seed: int = 0) -> tuple:
    shapes = ((INNER, HIDDEN), (INNER, HIDDEN), (HIDDEN, INNER))
    return tuple(
        (random_blocks(q, *s, seed + i), q, s)
        for i, (q, s) in enumerate(zip(qtypes, shapes, strict=True))
    )


def with_k_quant_experts(src, out, gate_up: QType = QType.Q4_K, down: QType = QType.Q6_K):
    """The GGUF ``src`` rewritten as ``out`` with its fused experts replaced by random
    blocks of ``gate_up`` (gate and up) and ``down``, as a Q4_K_M file stores them; the
    rest as it was. Returns ``out``."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, str(r.fields["general.architecture"].contents()))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    for i, t in enumerate(r.tensors):
        part = next(
            (p for p in ("gate", "up", "down") if t.name.endswith(f"ffn_{p}_exps.weight")), None
        )
        if part is None:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            continue
        qtype = down if part == "down" else gate_up
        experts, rows, cols = (int(n) for n in reversed(t.shape))
        width, bb = block_shape(qtype)
        raw = random_blocks(qtype, experts * rows, cols, seed=i).numpy()
        w.add_tensor(t.name, raw.reshape(experts, rows, cols // width * bb), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
