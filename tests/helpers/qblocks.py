"""Random quantized blocks with sane scales, for kernel tests."""

from __future__ import annotations

import torch

from backend.kernels.quants import QType, block_shape

HIDDEN, INNER = 64, 96


def random_blocks(qtype: QType, rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    _, bb = block_shape(qtype)
    n = rows * cols // 32
    raw = torch.randint(0, 256, (n, bb), dtype=torch.uint8, generator=g)
    n_scales = 2 if qtype == QType.Q4_1 else 1
    scales = (torch.randn((n, n_scales), generator=g) * 0.05).half()
    raw[:, : 2 * n_scales] = scales.view(torch.uint8).view(n, 2 * n_scales)
    return raw.reshape(-1)


def random_expert(qtypes: tuple[QType, QType, QType], seed: int = 0) -> tuple:
    shapes = ((INNER, HIDDEN), (INNER, HIDDEN), (HIDDEN, INNER))
    return tuple(
        (random_blocks(q, *s, seed + i), q, s)
        for i, (q, s) in enumerate(zip(qtypes, shapes, strict=True))
    )
