"""The compiled expert backend: Inductor graphs on experts' stored Q4 bytes (CPU).

Where the native kernels do not build (no C compiler with OpenMP, another CPU), the
same product from the quantized bytes comes from graphs compiled once per expert kind
and row bucket; more rows than the buckets take dequantize-then-matmul.
"""

from __future__ import annotations

import torch

from backend.engine.experts.eager import EagerExperts
from backend.kernels import qmatmul


class CompiledExperts(EagerExperts):
    name = "compiled"

    def mlp(self, layer: int, e: int, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > qmatmul.MAX_ROWS:
            return super().mlp(layer, e, x)
        out = qmatmul.compiled_mlp(self.stored_parts(layer, e), x)
        if out is None:  # a graph that failed at run time (logged by qmatmul)
            self.refused(f"expert {(layer, e)}")
            return super().mlp(layer, e, x)
        return out
