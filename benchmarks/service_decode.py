"""Decode speed as the app and `bevy serve` get it: N chat requests through an
``EngineService`` (the engine on its own thread, events dispatched on another), no HTTP.

    python benchmarks/service_decode.py [--requests 1] [--tokens 128] [--cache 1.0]
        [--policy bevy] [--rounds 3] [--model GGUF]

Each round submits the first N bundled chat prompts at once (greedy, EOS ignored) and
prints decode tokens/s (from the moment every request has its first token to the last
token) and tokens/s over the whole round. The first round includes the engine's warm-up
(first pages, kernels); later rounds are the steady state.
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench.runner import prompts_for  # noqa: E402
from backend.config import EngineConfig, SamplingParams  # noqa: E402
from backend.demo.build import ensure_demo  # noqa: E402
from backend.messages import ErrorEvent, Finished, Submit, TokenEvent  # noqa: E402
from backend.serving.service import EngineService  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the demo MoE)")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--cache", default="1.0")
    ap.add_argument("--policy", default="bevy")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = args.model or ensure_demo(quiet=False)
    cfg = EngineConfig(cache=args.cache, policy=args.policy, max_active=max(args.requests, 1))
    svc = EngineService.open(model, cfg)
    try:
        prompts = prompts_for(svc.model, "chat", args.requests)
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        for rnd in range(args.rounds):
            events: queue.Queue = queue.Queue()
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                svc.submit(Submit(f"r{rnd}-{i}", params, prompt_ids=p), events.put)
            seen: set[str] = set()
            first = None
            n = ended = 0
            while ended < len(prompts):
                ev = events.get(timeout=600)
                if isinstance(ev, TokenEvent) and ev.token_id >= 0:
                    n += 1
                    seen.add(ev.request_id)
                    if first is None and len(seen) == len(prompts):
                        first = (time.perf_counter(), n)
                elif isinstance(ev, ErrorEvent):
                    raise SystemExit(f"request {ev.request_id} failed: {ev.message}")
                elif isinstance(ev, Finished):
                    ended += 1
            t1 = time.perf_counter()
            decode = (n - first[1]) / (t1 - first[0]) if first and t1 > first[0] else 0.0
            print(
                f"round {rnd + 1}: {n} tokens, decode {decode:.1f} tok/s, "
                f"all {n / (t1 - t0):.1f} tok/s",
                flush=True,
            )
    finally:
        svc.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
