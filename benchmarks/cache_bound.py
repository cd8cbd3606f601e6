"""How few experts could any cache of this size fetch? A bound on decoding at a budget.

Decodes ``--requests`` bundled prompts together (greedy, ``--tokens`` each, every expert
resident, the lockstep order: every request at a layer before any goes to the next)
and records each layer's routing. It then replays that order against a cache of
``--cache`` of all experts, each step's layer needing the union of its requests'
experts (pinned while it runs), and counts fetches per decoding step:

- LFU, evicting the expert used least often so far: the engine's default order, run
  by the engine's own ``ExpertCache``;
- Belady's MIN, evicting the one needed again furthest in the future: no online
  policy can fetch fewer.

At a budget where decoding is link-bound, tokens/s is at most link bandwidth / (fetches
per step x expert bytes) x requests, so MIN's count bounds what any eviction order could
give there.

    python benchmarks/cache_bound.py [--requests 8] [--cache 0.3] [--tokens 64]
        [--workload chat]

The demo MoE is built on first use.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench.runner import prompts_for  # noqa: E402
from backend.config import EngineConfig, SamplingParams  # noqa: E402
from backend.demo.build import ensure_demo  # noqa: E402
from backend.engine.cache import ExpertCache  # noqa: E402
from backend.engine.loop import Engine  # noqa: E402
from backend.messages import Submit  # noqa: E402
from backend.models.loader import load_model  # noqa: E402

Key = tuple[int, int]


def record_routing(model, prompts: list[list[int]], tokens: int) -> list[tuple[int, int, tuple]]:
    """(token index, layer, experts) of every decoding request at every layer."""
    eng = Engine(
        model,
        EngineConfig(
            cache="1.0",
            policy="sync",
            max_active=len(prompts),
            kv_budget_mib=1 << 16,
            metrics_interval_s=3600,
        ),
    )
    routes: list[tuple[int, int, tuple]] = []
    seen = eng._on_route

    def on_route(r) -> None:
        if r.n == 1:
            routes.append((len(r.out_ids), r.layer, tuple(r.needed)))
        seen(r)

    eng._on_route = eng.jobs.on_route = on_route  # the layer walk reports through _on_pass
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.submit(Submit(f"r{i}", params, prompt_ids=p))
    try:
        eng.run_until_idle(3600)
    finally:
        eng.close()
    return routes


def replay(
    routes: list[tuple[int, int, tuple]], capacity: int, policy: str
) -> tuple[int, int, int]:
    """(steps, expert lookups, fetches) over the lockstep order: ``policy`` is the engine's
    own cache (``ExpertCache``, the eviction code a live engine runs) or "min"."""
    need: dict[tuple[int, int], set[int]] = defaultdict(set)
    uses: dict[tuple[int, int], list[int]] = defaultdict(list)
    for t, layer, experts in routes:
        need[(t, layer)].update(experts)
        uses[(t, layer)].extend(experts)
    order = sorted(need)
    batches = [[(layer, e) for e in sorted(need[(t, layer)])] for t, layer in order]
    steps = len({t for t, _ in order})
    lookups = sum(map(len, batches))
    if policy != "min":
        cache = ExpertCache(capacity, policy)
        fetched = 0
        for at, batch in zip(order, batches, strict=True):
            for e in uses[at]:
                cache.record_use((at[1], e))
            for k in batch:  # the step's layer holds its experts while it runs
                if cache.is_present(k):
                    cache.pin(k)
                else:
                    cache.reserve(k)
                    cache.complete(k)
                    fetched += 1
            for k in batch:
                cache.unpin(k)
        return steps, lookups, fetched

    when: dict[Key, list[int]] = defaultdict(list)
    for i, batch in enumerate(batches):
        for k in batch:
            when[k].append(i)
    seen: Counter[Key] = Counter()
    held: set[Key] = set()
    fetched = 0
    for batch in batches:
        for k in batch:
            seen[k] += 1
        for k in batch:
            if k not in held:
                fetched += 1
                if len(held) >= capacity:

                    def next_use(c: Key) -> int:
                        later = when[c][seen[c] :]
                        return later[0] if later else sys.maxsize

                    held.remove(max((c for c in held if c not in batch), key=next_use))
                held.add(k)
    return steps, lookups, fetched


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF (default: the demo MoE)")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument(
        "--cache", default="0.3", help="cache fractions of all experts, comma-separated"
    )
    args = ap.parse_args()
    model = load_model(args.model or ensure_demo())
    n_experts = sum(len(layer) for layer in model.experts)
    routes = record_routing(model, prompts_for(model, args.workload, args.requests), args.tokens)
    print(f"{args.requests} {args.workload} requests, {args.tokens} tokens, {n_experts} experts")
    print("cache  slots  lookups/step  LFU fetches/step  MIN fetches/step  MIN / LFU")
    for fraction in (float(f) for f in args.cache.split(",")):
        slots = int(fraction * n_experts)
        steps, lookups, lfu = replay(routes, slots, "lfu")
        _, _, best = replay(routes, slots, "min")
        print(
            f"{fraction:5.0%}  {slots:5d}  {lookups / steps:12.1f}  {lfu / steps:16.1f}"
            f"  {best / steps:16.1f}  {best / lfu:9.2f}"
        )


if __name__ == "__main__":
    main()
