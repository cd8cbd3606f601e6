"""The plain sequential forward every engine path is checked against."""

from __future__ import annotations

import torch

from backend.models.loader import LoadedModel
from backend.models.transformer import KVCache, SeqSlice


def greedy_logits(
    model: LoadedModel, prompt: list[int], steps: int, get_expert=None
) -> tuple[list[int], torch.Tensor]:
    """Prefill then ``steps`` greedy decode steps; logits at every predicting position."""
    t = model.transformer
    get_expert = get_expert or model.resident_experts().get
    kv = KVCache(model.config.n_layers)
    ids = list(prompt)
    out = [t.forward(torch.tensor(ids), [SeqSlice(kv, 0, len(ids))], get_expert)[0]]
    for _ in range(steps):
        ids.append(int(out[-1].argmax()))
        out.append(
            t.forward(torch.tensor(ids[-1:]), [SeqSlice(kv, len(ids) - 1, 1)], get_expert)[0]
        )
    return ids, torch.stack(out)
