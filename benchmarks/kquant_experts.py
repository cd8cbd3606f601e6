"""One expert's MLP per decoding row, by block type: the native kernels on stored bytes
against dequantize-then-matmul (the eager backend, what K-quant experts ran on before).

    python benchmarks/kquant_experts.py [--inner 768] [--hidden 2048] [--rows 1,4]

Experts of Qwen3-30B-A3B's shape by default ([768, 2048] gate and up, [2048, 768] down),
64 of each type taken in turn so that their bytes are not all in the CPU cache, as in
decoding. Prints the median milliseconds per expert call over ``--rounds`` rounds, and
each type's eager / native ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.kernels import native  # noqa: E402
from backend.kernels.quants import QType, dequantize  # noqa: E402
from tests.helpers.qblocks import random_blocks  # noqa: E402

# Q4_K_M files: Q4_K gate and up, down Q6_K in about half the layers and Q4_K in the rest;
# Q5_K_M files likewise with Q5_K.
KINDS = {
    "Q4_0": (QType.Q4_0, QType.Q4_0, QType.Q4_0),
    "Q4_K": (QType.Q4_K, QType.Q4_K, QType.Q4_K),
    "Q4_K + Q6_K down": (QType.Q4_K, QType.Q4_K, QType.Q6_K),
    "Q5_K + Q6_K down": (QType.Q5_K, QType.Q5_K, QType.Q6_K),  # Q5_K_M
    "Q8_0": (QType.Q8_0, QType.Q8_0, QType.Q8_0),
    "Q3_K + Q5_K down": (QType.Q3_K, QType.Q3_K, QType.Q5_K),  # Q3_K_M
    "IQ4_XS": (QType.IQ4_XS, QType.IQ4_XS, QType.IQ4_XS),
    # Gemma 4's Q4_K_M: its 704-wide down rows cannot be K-quants; GELU-gated
    "Q4_K + Q5_0 down, GELU": (QType.Q4_K, QType.Q4_K, QType.Q5_0),
}


def eager(parts, x: torch.Tensor, act: str) -> torch.Tensor:
    g, u, d = (dequantize(raw, q, s) for raw, q, s in parts)
    a = F.silu(F.linear(x, g)) if act == "silu" else F.gelu(F.linear(x, g), approximate="tanh")
    return F.linear(a * F.linear(x, u), d)


def timed(fn, experts: list, x: torch.Tensor, rounds: int) -> float:
    """Median over rounds of the mean ms per call, each round through every expert."""
    fn(experts[0], x)
    per = []
    for _ in range(rounds):
        t = time.perf_counter()
        for e in experts:
            fn(e, x)
        per.append((time.perf_counter() - t) / len(experts) * 1e3)
    return statistics.median(per)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inner", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not native.available():
        print("the native kernels do not build here")
        return 1
    shapes = ((args.inner, args.hidden), (args.inner, args.hidden), (args.hidden, args.inner))
    print(f"expert [{args.inner}, {args.hidden}], {torch.get_num_threads()} threads, ms per call")
    for name, qtypes in KINDS.items():
        experts = [
            tuple(
                (random_blocks(q, *s, seed=100 * e + i), q, s)
                for i, (q, s) in enumerate(zip(qtypes, shapes, strict=True))
            )
            for e in range(args.experts)
        ]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.hidden, generator=torch.Generator().manual_seed(rows))
            act = "gelu" if "GELU" in name else "silu"
            fast = timed(partial(native.expert_mlp, act=act), experts, x, args.rounds)
            slow = timed(partial(eager, act=act), experts[:8], x, args.rounds)
            print(
                f"{name:24} rows {rows}: native {fast:.3f}  eager {slow:.3f}  ({slow / fast:.0f}x)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
