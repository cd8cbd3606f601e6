"""Where do the native Q4 kernels stop beating dequantize-then-BLAS for one expert?

    python benchmarks/expert_rows.py [--rows 8,16,32,64,128,256] [--experts 200]

Loads every expert of the demo MoE into an engine's cache slots (100 %, host store), then
times one expert's MLP on R random rows both ways (``native.expert_mlp`` on the stored
blocks; ``EagerExperts.mlp``: dequantize, then torch's matmuls), taking the experts in
turn so that their bytes are not in the CPU's cache, and prints the medians in ms. The
engine's ``NATIVE_MAX_ROWS`` is where the two cross.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.config import EngineConfig, SamplingParams  # noqa: E402
from backend.demo.build import ensure_demo  # noqa: E402
from backend.engine.experts.eager import EagerExperts  # noqa: E402
from backend.engine.loop import Engine  # noqa: E402
from backend.engine.request import Request  # noqa: E402
from backend.kernels import native  # noqa: E402
from backend.serving.service import open_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8,16,32,64,128,256")
    ap.add_argument("--experts", type=int, default=200, help="experts timed per row count")
    args = ap.parse_args()
    model = open_model(ensure_demo(quiet=False))
    eng = Engine(model, EngineConfig(cache="1.0", storage="host"))
    c = model.config
    keys = [(layer, e) for layer in range(c.n_layers) for e in range(c.n_experts)]
    holder = Request("all", [], SamplingParams())
    for k, slot in eng.claims.claim(holder, keys) or []:
        eng.fetcher.submit((0,), k, model.experts[k[0]][k[1]], slot)
    while not all(eng.cache.is_ready(k) for k in keys):
        eng._drain(block=True, timeout=0.1)
    ex = eng.jobs.experts
    print("rows  native ms  dequantize+BLAS ms")
    try:
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, c.hidden_size)
            med = {}
            for name in ("native", "eager"):
                times = []
                for layer, e in keys[: args.experts]:
                    t0 = time.perf_counter()
                    if name == "native":
                        native.expert_mlp(ex.stored_parts(layer, e), x)
                    else:
                        EagerExperts.mlp(ex, layer, e, x)
                    times.append(time.perf_counter() - t0)
                med[name] = sorted(times)[len(times) // 2] * 1e3
            print(f"{rows:>4}  {med['native']:9.2f}  {med['eager']:18.2f}", flush=True)
    finally:
        eng.claims.release(holder)
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
