"""Policies side by side while another process keeps a CPU core busy (a user's desktop is
rarely quiet): the `bevy bench` measure, one configuration, with a busy loop beside it.

    python benchmarks/competing_load.py [--cache 0.3] [--requests 8] [--repeats 2]
        [--policies bevy,sync,bevy-nobalance] [--busy 1] [--model GGUF]

The busy processes (``python -c "while True: pass"``) start before the first run and stop
after the last; runs alternate A B C A B C so that drift cancels. Prints each run's decode
tokens/s and compute seconds, then each policy's median and its ratio to sync.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench.runner import BenchPlan, prompts_for, run_once  # noqa: E402
from backend.demo.build import ensure_demo  # noqa: E402
from backend.models.loader import load_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the demo MoE)")
    ap.add_argument("--cache", type=float, default=0.3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--policies", default="bevy,sync,bevy-nobalance")
    ap.add_argument("--busy", type=int, default=1, help="busy processes beside the engine")
    ap.add_argument("--workload", default="chat")
    args = ap.parse_args()
    model = load_model(args.model or ensure_demo(quiet=False))
    prompts = prompts_for(model, args.workload, args.requests)
    policies = args.policies.split(",")
    plan = BenchPlan(policies=tuple(policies), caches=(args.cache,))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    rates: dict[str, list[float]] = {p: [] for p in policies}
    try:
        for rep in range(args.repeats):
            for policy in policies:
                r = run_once(model, policy, prompts, args.cache, plan)
                rates[policy].append(r["tokens_per_s"])
                print(
                    f"run {rep + 1} {policy:16s} {r['tokens_per_s']:6.2f} tok/s  "
                    f"compute {r['compute_busy_s']:5.1f} s  link {r['link_busy_s']:5.1f} s  "
                    f"wall {r['wall_s']:5.1f} s  threads {r['compute_threads']} "
                    f"({r['pool_changes']} changes)",
                    flush=True,
                )
    finally:
        for p in busy:
            p.kill()
    base = statistics.median(rates["sync"]) if "sync" in rates else None
    print(f"\n{args.busy} busy process(es), cache {args.cache}, {args.requests} requests")
    for policy, got in rates.items():
        med = statistics.median(got)
        ratio = f"  {med / base:.2f}x sync" if base else ""
        print(f"{policy:16s} median {med:6.2f} tok/s{ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
