"""How long do several short prompts that arrive together take to read? ``--requests``
bundled chat prompts (about 40 tokens each on the demo) are submitted at once to a fresh
engine at a ``--cache`` fraction; reported: the time until every one has its first
token, the experts fetched, and the compute and link busy seconds over that time. The
policies alternate A B A B; ``bevy-nosplit`` is ``bevy`` whose waiting jobs never apply
the experts they have early (``scheduler.split``), so beside ``bevy`` it shows what a
prompt applying its layer's experts while the rest are still being read buys.

    python benchmarks/prompt_batch.py [--requests 8] [--cache 0.3] [--repeats 3]
        [--policies bevy,bevy-nosplit] [--workload chat]

Each engine's cache slots are written once before its prompts are submitted: memory a
process touches for the first time can take far longer to fault in than the reads
themselves (seconds for the demo's 30 % on a fresh VM), and would be measured instead.
The demo MoE is built on first use.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench.runner import prompts_for  # noqa: E402
from backend.config import EngineConfig, SamplingParams  # noqa: E402
from backend.demo.build import ensure_demo  # noqa: E402
from backend.engine.loop import Engine  # noqa: E402
from backend.messages import ErrorEvent, Submit, TokenEvent  # noqa: E402
from backend.models.loader import load_model  # noqa: E402


def read_once(model, prompts: list[list[int]], policy: str, cache: str) -> dict:
    config = EngineConfig(
        cache=cache,
        policy=policy,
        max_active=len(prompts),
        kv_budget_mib=1 << 16,
        metrics_interval_s=3600,
    )
    eng = Engine(model, config)
    try:
        eng.slots.fill_(0)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            eng.submit(Submit(f"p{i}", params, prompt_ids=p))
        first: dict[str, float] = {}
        while eng.has_work:
            eng.step()
            while not eng.events.empty():
                ev = eng.events.get()
                if isinstance(ev, ErrorEvent):
                    raise RuntimeError(ev.message)
                if isinstance(ev, TokenEvent) and ev.request_id not in first:
                    first[ev.request_id] = time.perf_counter() - t0
        t1 = time.perf_counter()
        w = eng.telemetry.window(t0, t1)
        return {
            "all_first_s": max(first.values()),
            "fetched": eng.telemetry.fetched,
            "compute_s": w["compute_busy_s"],
            "link_s": w["link_busy_s"],
        }
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF (default: the demo MoE)")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--cache", default="0.3")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default="bevy,bevy-nosplit")
    args = ap.parse_args()
    model = load_model(args.model or ensure_demo())
    prompts = prompts_for(model, args.workload, args.requests)
    policies = args.policies.split(",")
    print(
        f"{args.requests} {args.workload} prompts ({sum(map(len, prompts))} tokens), "
        f"cache {args.cache}"
    )
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for rep in range(args.repeats):
        for policy in policies:
            rec = read_once(model, prompts, policy, args.cache)
            runs[policy].append(rec)
            print(
                f"  [{rep + 1}] {policy:14s} all first tokens {rec['all_first_s']:.2f} s, "
                f"{rec['fetched']} fetched, compute {rec['compute_s']:.2f} s, "
                f"link {rec['link_s']:.2f} s",
                flush=True,
            )
    print("median time until every prompt has its first token:")
    base = statistics.median(r["all_first_s"] for r in runs[policies[-1]])
    for policy in policies:
        med = statistics.median(r["all_first_s"] for r in runs[policy])
        print(f"  {policy:14s} {med:.2f} s ({base / med:.2f}x {policies[-1]}'s speed)")


if __name__ == "__main__":
    main()
