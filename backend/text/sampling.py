"""Next-token choice from logits: repetition penalty, temperature, top-k, top-p, min-p."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backend.config import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(
        params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
    )
    return g


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    history: Sequence[int] = (),
    allowed: torch.Tensor | None = None,
) -> int:
    """``logits`` [V] (float32, any device) -> token id. ``history``: ids seen so far;
    ``allowed``: where set, a bool mask [V] of the tokens a grammar admits next."""
    # A copy: logits may be an inference-mode tensor, which must not be edited in place.
    logits = logits.detach().float().cpu().clone()
    if allowed is not None:
        logits.masked_fill_(~allowed, float("-inf"))
    if params.repetition_penalty != 1.0 and history:
        seen = torch.tensor(sorted(set(history)), dtype=torch.long)
        vals = logits[seen]
        # As in CTRL/transformers: shrink positive logits, push negative ones further down.
        logits[seen] = torch.where(
            vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty
        )
    if params.greedy:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_p.cumsum(0) - sorted_p >= params.top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
