"""What the engine's telemetry holds once its lanes are full, and what a live window costs.

    python benchmarks/telemetry_memory.py [--events 200000] [--module PATH]

Records ``--events`` link and compute events (and a token every 30) as an engine at 8
requests would, then prints the anonymous memory they took and the time of one 2-second
``window``, the read the balancer and the live panels make. ``--module`` measures another
version of ``backend/engine/telemetry.py`` (e.g. one from ``git show``) the same way.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from resident_memory import anon_mib  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--module", type=Path, default=ROOT / "backend/engine/telemetry.py")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("telemetry_under_test", args.module)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    import numpy  # noqa: F401  (imported before the baseline, as the engine has it)

    groups = [tuple(f"chatcmpl-{i:04d}" for i in range(j, j + 8)) for j in range(4)]
    before = anon_mib()
    t, now = mod.Telemetry(), 0.0
    for i in range(args.events):
        t.record_link(now, now + 1e-3, (i % 30, i % 32), 1658880, False)
        # a new tuple each time, as the engine builds one per compute call
        t.record_compute(now + 1e-3, now + 2e-3, i % 30, tuple(list(groups[i % 4])), 8)
        if i % 30 == 0:
            t.record_token(groups[0][0])
        now += 0.0031 if i % 3 else 0.002
    held = anon_mib() - before
    t0 = time.perf_counter()
    for _ in range(100):
        t.window(now - 2.0, now)
    per = (time.perf_counter() - t0) / 100
    print(f"{args.module}: {held:.0f} MiB for {args.events} link and compute events each")
    print(f"one 2-second window: {per * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
