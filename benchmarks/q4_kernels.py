"""Time the native Q4 expert kernel (``backend/kernels/q4_matmul.c``) per row count.

    python benchmarks/q4_kernels.py                        # this tree's kernels
    python benchmarks/q4_kernels.py --against OLD_DIR      # paired A/B against other sources
    mkdir -p /tmp/old && git archive HEAD~1 backend/kernels | tar -x -C /tmp/old && python benchmarks/q4_kernels.py --against /tmp/old/backend/kernels
    python benchmarks/q4_kernels.py --against OLD_DIR --decode --requests 8 --cache 0.7

``--against`` takes a directory (its ``*.c`` compiled together, its ``*.h`` in the build's
key: another tree's ``backend/kernels``) or one C file that holds all the kernels, as
``native_q4.c`` did before the sources were split (``git show REV:backend/kernels/native_q4.c
> /tmp/old.c``; ``backend/formats/native_q4.c`` before the move to ``backend/kernels``).
Either must export every function ``backend.kernels.native`` binds.

``--packed`` compares this tree's kernels on the experts as stored against the same experts
packed 16 rows to a group (``native.pack``, what the engine's native backend does to each
Q4_0/Q4_1 expert in its slot as the slot fills), checking that the two give the
same bits (both read x rounded to 8 bits per block of 32, as ggml's CPU kernels do);
with ``--decode``, the engine with and without packing; with ``--against``, the packed
experts on this tree's kernels and on the other build's. ``--pack`` times the packing
itself (``native.pack`` of an expert's three parts, fresh copies out of the CPU's caches)
on one thread and on ``--threads``, with ``--against`` for both builds (the same bytes
checked).

``--decode`` compares whole decoding runs instead (``bevy bench``'s run on the demo MoE,
``--storage ssd``), each policy with each build in turn, and prints decode tokens/s: the
medians, and the median of each round's ratio (its two runs back to back).

Experts of the demo's shape ([1536, 576] gate and up, [576, 1536] down; Q4_1, every
fourth Q4_0), 64 of them (``--experts``) taken in turn so that their bytes are not all in
the CPU cache, as in decoding. ``--kind "Q4_K + Q6_K down"`` (any of
``kquant_experts.KINDS``) times experts of that file type and Qwen3-30B-A3B's shape
instead. With ``--against``, both
builds run interleaved in one process (the order alternating between rounds, so that
drift of the machine cancels), the medians are compared, and every output of the two is
checked to be the same bits unless ``--allow-different-bits``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.kernels import native  # noqa: E402
from backend.kernels.quants import QType  # noqa: E402

HIDDEN, INNER, EXPERTS = 576, 1536, 64


def _raw(qtype: QType, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Random Q4 blocks with small f16 scales (a quantized layer's bytes)."""
    size = 20 if qtype == QType.Q4_1 else 18
    n_scales = 2 if qtype == QType.Q4_1 else 1
    n = rows * cols // 32
    raw = torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=gen)
    scales = (torch.randn((n, n_scales), generator=gen) * 0.05).half()
    raw[:, : 2 * n_scales] = scales.view(torch.uint8).view(n, 2 * n_scales)
    return raw.reshape(-1)


def experts(n: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for e in range(n):
        q = QType.Q4_0 if e % 4 == 0 else QType.Q4_1
        shapes = ((INNER, HIDDEN), (INNER, HIDDEN), (HIDDEN, INNER))
        out.append(tuple((_raw(q, *s, gen), q, s) for s in shapes))
    return out


def k_experts(kind: str, n: int) -> tuple[list[tuple], int]:
    """n experts of one of ``kquant_experts.KINDS`` at its default shape, and the width of
    their input."""
    from kquant_experts import KINDS

    from tests.helpers.qblocks import random_blocks

    inner, hidden = 768, 2048
    shapes = ((inner, hidden), (inner, hidden), (hidden, inner))
    out = [
        tuple(
            (random_blocks(q, *s, seed=100 * e + i), q, s)
            for i, (q, s) in enumerate(zip(KINDS[kind], shapes, strict=True))
        )
        for e in range(n)
    ]
    return out, hidden


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--against",
        type=Path,
        help="other kernel sources to compare with: a directory of them or one C file",
    )
    ap.add_argument("--rows", default="1,2,3,4,8")
    ap.add_argument("--kind", help="a kquant_experts.KINDS name (default: the demo's Q4_1)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--experts", type=int, default=EXPERTS, help="experts taken in turn")
    ap.add_argument("--allow-different-bits", action="store_true")
    ap.add_argument("--packed", action="store_true", help="as stored against packed (above)")
    ap.add_argument("--decode", action="store_true", help="time decoding runs (see above)")
    ap.add_argument("--pack", action="store_true", help="time the packing (see above)")
    ap.add_argument("--policies", default="bevy,sync")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--cache", type=float, default=0.7)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    builds = {"this tree": native.build()}
    if args.against:
        out = Path(tempfile.mkdtemp(prefix="bevy-q4-"))
        builds["against"] = native.build(out, source=args.against)
    torch.set_num_threads(args.threads)
    if args.decode:
        return decode(builds, args)
    parts, hidden = (
        k_experts(args.kind, args.experts) if args.kind else (experts(args.experts), HIDDEN)
    )
    if args.pack:
        return pack_times(parts, builds, args)
    # name -> (library, experts, which of each expert's parts are packed)
    plain = [(False,) * 3] * len(parts)
    variants = {name: (lib, parts, plain) for name, lib in builds.items()}
    if args.packed:
        native._lib, native._tried = builds["this tree"], True
        packed, flags = [], []
        for expert in parts:
            copies = [raw.clone() for raw, _, _ in expert]
            flags.append(
                tuple(native.pack(c, q, s) for c, (_, q, s) in zip(copies, expert, strict=True))
            )
            packed.append(tuple((c, q, s) for c, (_, q, s) in zip(copies, expert, strict=True)))
        if not any(any(f) for f in flags):
            print("this build packs none of these experts (Q4_0/Q4_1 only)", file=sys.stderr)
            return 1
        variants = {
            "as stored": variants["this tree"],
            "packed": (builds["this tree"], packed, flags),
        }
        if args.against:  # the packed experts on both builds (the layout is the same)
            variants = {name: (lib, packed, flags) for name, lib in builds.items()}
    rows = [int(r) for r in args.rows.split(",")]
    times: dict[tuple[int, str], list[float]] = {}
    for rnd in range(args.rounds):
        for m in rows:
            x = torch.randn(m, hidden, generator=torch.Generator().manual_seed(m))
            outs = {}
            for name in variants if rnd % 2 == 0 else reversed(variants):
                lib, ps, fs = variants[name]
                native._lib, native._tried = lib, True  # library() keeps it
                t = time.perf_counter()
                outs[name] = [
                    native.expert_mlp(p, x, "silu", f) for p, f in zip(ps, fs, strict=True)
                ]
                times.setdefault((m, name), []).append((time.perf_counter() - t) / len(parts))
            a, b = outs.values() if len(outs) == 2 else (None, None)
            if a is not None and not args.allow_different_bits:
                same = all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
                if not same:
                    print(
                        f"{m} rows: {' and '.join(variants)} differ in their bits", file=sys.stderr
                    )
                    return 1
    shape = f"{parts[0][0][2][0]}, {hidden}"
    kind = args.kind or "demo Q4_1"
    print(f"one {kind} expert [{shape}] per call, {args.threads} threads, median of {args.rounds}")
    for m in rows:
        line = f"{m} rows: " + "  ".join(
            f"{name} {1e3 * statistics.median(times[(m, name)]):.3f} ms" for name in variants
        )
        if len(variants) == 2:
            first, second = variants
            mine, other = (statistics.median(times[(m, n)]) for n in variants)
            line += f"  ({first} / {second}: {mine / other:.3f})"
        print(line)
    return 0


def pack_times(parts: list[tuple], builds: dict, args: argparse.Namespace) -> int:
    """Milliseconds per expert to pack its parts, on one thread and on ``args.threads``,
    with each build (``--against``), alternating between rounds; each round packs fresh
    copies of all the experts, and every build's packed bytes must be the same."""
    counts = sorted({1, args.threads})
    runs = [(name, t) for name in builds for t in counts]
    times: dict[tuple[str, int], list[float]] = {run: [] for run in runs}
    for rnd in range(args.rounds):
        packed = {}
        for name, t in runs if rnd % 2 == 0 else reversed(runs):
            copies = [[raw.clone() for raw, _, _ in expert] for expert in parts]
            native._lib, native._tried = builds[name], True  # library() keeps it
            torch.set_num_threads(t)
            start = time.perf_counter()
            for expert, mine in zip(parts, copies, strict=True):
                for (_, q, s), c in zip(expert, mine, strict=True):
                    if not native.pack(c, q, s):
                        print(f"{q.name} {s} does not pack (Q4_0 / Q4_1 only)", file=sys.stderr)
                        return 1
            times[(name, t)].append((time.perf_counter() - start) / len(parts))
            packed.setdefault(name, copies)
        first, *others = packed.values()
        if any(not all(map(torch.equal, sum(first, []), sum(o, []))) for o in others):
            print(f"{' and '.join(builds)} pack to different bytes", file=sys.stderr)
            return 1
    torch.set_num_threads(args.threads)
    print(f"packing one expert ({len(parts)} in turn), median of {args.rounds}")
    for name, t in runs:
        print(f"{name}, {t} thread(s): {1e3 * statistics.median(times[(name, t)]):.3f} ms")
    return 0


def decode(builds: dict, args: argparse.Namespace) -> int:
    """Decode tokens/s of each policy on each build, interleaved, with median per pair."""
    from backend.bench.runner import BenchPlan, prompts_for, run_once
    from backend.demo.build import ensure_demo
    from backend.models.loader import load_model

    model = load_model(ensure_demo())
    plan = BenchPlan(tokens=args.tokens, storage="ssd")
    prompts = prompts_for(model, args.workload, args.requests)
    got: dict[tuple[str, str], list[float]] = {}
    tokens: dict[tuple[str, str], list] = {}
    # name -> (library, whether the engine packs its Q4 experts)
    runs = {name: (lib, True) for name, lib in builds.items()}
    if args.packed:
        runs = {"packed": (builds["this tree"], True), "as stored": (builds["this tree"], False)}
    pack = native.pack
    for rnd in range(args.rounds):
        for policy in args.policies.split(","):
            for name in runs if rnd % 2 == 0 else reversed(runs):
                native._lib, native._tried = runs[name][0], True
                native.pack = pack if runs[name][1] else (lambda *_: False)
                rec = run_once(model, policy, prompts, args.cache, plan)
                got.setdefault((policy, name), []).append(rec["tokens_per_s"])
                tokens.setdefault((policy, name), []).append(rec["tokens"])
                print(f"[{rnd + 1}/{args.rounds}] {policy} {name}: {rec['tokens_per_s']:.2f} tok/s")
    print(
        f"{args.workload}, {args.requests} requests, cache {args.cache:.0%}, "
        f"{args.tokens} tokens, median of {args.rounds}"
    )
    for policy in args.policies.split(","):
        line = f"{policy}: " + "  ".join(
            f"{name} {statistics.median(got[(policy, name)]):.2f} tok/s" for name in runs
        )
        if len(runs) == 2:
            first, second = runs
            mine, other = (statistics.median(got[(policy, n)]) for n in runs)
            line += f"  ({first} / {second}: {mine / other:.3f}"
            # Each round's pair ran back to back: their ratio cancels the machine's drift
            # through the run, which the ratio of the two medians does not.
            paired = [a / b for a, b in zip(*(got[(policy, n)] for n in runs), strict=True)]
            line += f"; median of the rounds' ratios {statistics.median(paired):.3f})"
            same = all(t == tokens[(policy, first)][0] for n in runs for t in tokens[(policy, n)])
            line += "" if same else "  TOKENS DIFFER"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
