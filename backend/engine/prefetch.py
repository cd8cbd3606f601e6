"""Prefetching baselines: guess the next layer's experts and fetch them on the idle link.

- ``gate`` (Pre-gated / SpecMD style): apply layer l+1's router to layer l's MoE input.
- ``history`` (FineMoE style): experts that most often followed this request's current
  experts in layer l+1, from co-activation counts recorded during the run.
Prefetched entries are not pinned: a wrong guess is simply evicted later. The cache counts
each prefetch, and each one no job claimed before it was evicted or the run ended.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backend.engine.cache import Claims
from backend.engine.request import Request
from backend.engine.telemetry import Telemetry
from backend.models.loader import LoadedModel

PREFETCH_PRIORITY = 1 << 60  # after every demand fetch in the link's queue


class Prefetcher:
    def __init__(self, kind: str, model: LoadedModel, claims: Claims, telemetry: Telemetry) -> None:
        if kind not in ("gate", "history"):
            raise ValueError(f"unknown prefetch kind {kind!r}")
        self.kind = kind
        self.model = model
        self.claims = claims
        self.cache = claims.cache
        self.telemetry = telemetry
        c = model.config
        self.counts = torch.zeros(c.n_layers, max(c.n_experts, 1), max(c.n_experts, 1))
        self._prev: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._issued: set[tuple[str, int, int]] = set()

    def observe(self, r: Request) -> None:
        """A request's routing for its current layer is known."""
        prev = self._prev.get(r.id)
        if prev is not None and prev[0] + 1 == r.layer and prev[1] and r.needed:
            src = torch.tensor(prev[1], dtype=torch.long)
            dst = torch.tensor(r.needed, dtype=torch.long)
            self.counts[prev[0]][src[:, None], dst[None, :]] += 1
        self._prev[r.id] = (r.layer, r.needed)

    def predict(self, r: Request) -> list[int]:
        c = self.model.config
        nxt = r.layer + 1
        if nxt >= c.n_layers or not c.sparse_layers[nxt]:
            return []
        if self.kind == "gate":
            t = self.model.transformer
            ids, _ = t.route(nxt, t.router_input(nxt, r.h, r.x))
            return sorted(set(ids.flatten().tolist()))
        if not r.needed:
            return []
        scores = self.counts[r.layer][list(r.needed)].sum(0)
        if scores.sum() == 0:
            return []
        k = min(c.top_k * r.n, c.n_experts)
        return sorted(i for i in scores.topk(k).indices.tolist() if scores[i] > 0)

    def issue(self, fetcher, running: Sequence[Request]) -> None:
        """Queue prefetches for requests whose current layer is routed and not yet predicted."""
        for r in running:
            tag = (r.id, r.start, r.layer)  # once per token position and layer
            if tag in self._issued or r.x is None:
                continue
            self._issued.add(tag)
            for e in self.predict(r):
                key = (r.layer + 1, e)
                if self.cache.is_present(key):
                    continue
                slot = self.claims.guess(key)
                if slot is None:
                    return  # no unpinned slot: guessing would evict what jobs need
                fetcher.submit(
                    (PREFETCH_PRIORITY, r.layer),
                    key,
                    self.model.experts[key[0]][e],
                    slot,
                    prefetch=True,
                )
        if len(self._issued) > 100_000:
            self._issued.clear()

    def unused_fraction(self) -> float:
        """Prefetches no job claimed: evicted unused, or still unclaimed now."""
        s = self.cache.stats
        return (s.prefetch_wasted + len(self.cache.guessed)) / s.prefetched if s.prefetched else 0.0
