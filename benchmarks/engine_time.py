"""Where the engine thread's decoding time goes: native kernels, and the Python between them.

Runs ``bevy bench``'s configuration (``backend.bench.runner.run_once``: fresh engine,
cold cache, the bundled prompts, greedy) once per policy, with timers around the
engine's steps and the native calls, counted from the moment every request has its
first token (the bench's decoding window). For each policy it prints each timed
function's seconds, calls and time per call, then the compute runs split in two: time
in the native kernels (attention block, the layer's experts, the decode walk, dense
products) and the rest, the Python and small torch ops that schedule and glue them,
which a policy pays per run. Packing landed Q4 experts runs between runs (``_drain``).

    python benchmarks/engine_time.py [--workload agentic] [--requests 8] [--cache 0.5]
        [--policies bevy,sync] [--tokens 64]

Each timer costs about a microsecond a call: some 75,000 calls, under a tenth of a second. The
demo MoE is built on first use. Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench.runner import BenchPlan, prompts_for, run_once  # noqa: E402
from backend.demo.build import ensure_demo  # noqa: E402
from backend.engine import jobs  # noqa: E402
from backend.engine.loop import Engine  # noqa: E402
from backend.kernels import decode, native  # noqa: E402
from backend.models.loader import load_model  # noqa: E402

# (owner, attribute, label): the engine's parts of a step, and what a run calls
STEPS = [
    (Engine, "step", "step"),
    (Engine, "_drain", "drain (fetches landed, packing)"),
    (Engine, "_schedule", "schedule (claims, groups)"),
    (Engine, "_run", "run"),
    (Engine, "_run_split", "split run"),
    (Engine, "_run_slice", "prompt slice"),
    (jobs.JobRunner, "_moe", "  experts (JobRunner._moe)"),
    (jobs.JobRunner, "enter", "  attention + router (JobRunner.enter)"),
    (jobs.JobRunner, "run_through", "  walk through resident layers"),
]
RUNS = ("_run", "_run_split", "_run_slice")
NATIVE = [
    (native, "attention_block", "native attention block"),
    (native, "moe", "native experts of a layer"),
    (native, "expert_mlp", "native one expert"),
    (native, "linear", "native dense product"),
    (decode.Walk, "run", "native decode walk"),
    (native, "pack", "native packing"),
]


class Timers:
    """Seconds and calls per label, counted once ``on`` is set; native time spent inside
    a compute run also goes to ``in_runs``."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.on = False
        self.depth = 0  # compute runs open on the stack
        self.in_runs = 0.0

    def wrap(self, owner, name: str, label: str, run: bool = False, kernel: bool = False):
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            self.depth += run
            try:
                return real(*args, **kwargs)
            finally:
                self.depth -= run
                if self.on:
                    dt = time.perf_counter() - t0
                    self.seconds[label] += dt
                    self.calls[label] += 1
                    if kernel and self.depth:
                        self.in_runs += dt

        setattr(owner, name, timed)
        return real


def measure(model, policy: str, prompts: list[list[int]], cache: float, tokens: int) -> None:
    timers = Timers()
    saved = []
    for owner, name, label in STEPS:
        saved.append((owner, name, timers.wrap(owner, name, label, run=name in RUNS)))
    for owner, name, label in NATIVE:
        saved.append((owner, name, timers.wrap(owner, name, label, kernel=name != "pack")))
    started: set[str] = set()
    post = Engine._postprocess

    def postprocess(eng, r, logits):
        started.add(r.id)
        if len(started) == len(prompts) and not timers.on:
            timers.on = True  # every request has its first token: decoding from here
        return post(eng, r, logits)

    saved.append((Engine, "_postprocess", post))
    Engine._postprocess = postprocess
    try:
        rec = run_once(model, policy, prompts, cache, BenchPlan(tokens=tokens))
    finally:
        for owner, name, real in reversed(saved):
            setattr(owner, name, real)
    print(
        f"\n{policy}: {rec['tokens_per_s']:.2f} tok/s decoding, {rec['wall_s']:.2f} s "
        f"(compute {rec['compute_busy_s']:.2f} s, link {rec['link_busy_s']:.2f} s)"
    )
    print(f"{'':40s} {'seconds':>8s} {'calls':>7s} {'ms/call':>8s}")
    for _, _, label in STEPS + NATIVE:
        n = timers.calls[label]
        if n:
            s = timers.seconds[label]
            print(f"{label:40s} {s:8.2f} {n:7d} {s / n * 1e3:8.3f}")
    runs = sum(timers.seconds[label] for owner, name, label in STEPS if name in RUNS)
    n_runs = sum(timers.calls[label] for owner, name, label in STEPS if name in RUNS)
    if n_runs:
        rest = runs - timers.in_runs
        print(
            f"compute runs: {n_runs}, {runs:.2f} s: native kernels {timers.in_runs:.2f} s, "
            f"the rest {rest:.2f} s ({rest / n_runs * 1e3:.3f} ms a run)"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="agentic")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--cache", type=float, default=0.5)
    ap.add_argument("--policies", default="bevy,sync")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    model = load_model(ensure_demo())
    prompts = prompts_for(model, args.workload, args.requests)
    for policy in args.policies.split(","):
        measure(model, policy, prompts, args.cache, args.tokens)


if __name__ == "__main__":
    main()
