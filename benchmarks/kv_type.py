"""The KV cache in float16 against float32 (``--kv-type f16`` against the default).

Runs ``bevy bench``'s configuration (``backend.bench.runner.run_once``: fresh engine,
cold cache, the bundled prompts, greedy) for each policy with each cache type,
alternating them round by round so that the disk's and the machine's swings fall on
both alike, and checks every run's tokens against plain generation with the same cache
type. Prints each run, then per policy the median decode tok/s of each type, their
ratio, and the peak of what the engine held (KV included).

    python benchmarks/kv_type.py [--workload agentic] [--requests 8] [--cache 0.5]
        [--policies bevy,sync] [--tokens 64] [--rounds 3] [--storage ssd]

With ``--blocks 300,1250,4000``: instead, one decoding step's native attention blocks
(every layer, ``--requests`` rows, each with that many cached positions, a cache per
layer and row as a running engine holds them) timed with each cache type; with
``--against OLD_DIR`` too (another tree's ``backend/kernels``), on this tree's kernels
and on those, alternating, the same bits checked:

    mkdir -p /tmp/old && git archive HEAD~1 backend/kernels | tar -x -C /tmp/old
    python benchmarks/kv_type.py --blocks 300,1250,4000 --requests 3 --against /tmp/old/backend/kernels

The demo MoE is built on first use. Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench.runner import BenchPlan, prompts_for, run_once  # noqa: E402
from backend.demo.build import ensure_demo  # noqa: E402
from backend.models.generate import greedy_reference  # noqa: E402
from backend.models.loader import load_model  # noqa: E402

KINDS = ("auto", "f16")


def summarize(runs: list[dict]) -> list[dict]:
    """Per policy: the median tok/s and peak engine MiB of each cache type, f16's tok/s
    over auto's, and whether every run was exact."""
    out = []
    for policy in dict.fromkeys(r["policy"] for r in runs):
        row: dict = {"policy": policy}
        for kind in KINDS:
            mine = [r for r in runs if r["policy"] == policy and r["kv_type"] == kind]
            row[kind] = statistics.median(r["tokens_per_s"] for r in mine)
            row[f"{kind}_mib"] = max(r["peak_engine_mib"] for r in mine)
        row["ratio"] = row["f16"] / row["auto"]
        row["exact"] = all(r["exact"] for r in runs if r["policy"] == policy)
        out.append(row)
    return out


def time_blocks(
    model, rows: int, contexts: list[int], builds: dict | None = None, repeats: int = 10
) -> None:
    """Milliseconds per decoding step of the model's native attention blocks, float32
    caches against float16, at each context length. With ``builds`` (two names, each a
    loaded kernel library): each cache type on each, alternating over three rounds
    (medians), every output checked to be the same bits on both."""
    import time

    import torch

    from backend.kernels import native

    t, c = model.transformer, model.config
    blocks = [b for b in t.decode_blocks() if b is not None]
    if not blocks or not native.available():
        raise SystemExit("the native attention block does not take this model here")
    names, rounds = (list(builds), 3) if builds else ([None], 1)
    print(f"{rows} rows, {len(blocks)} layers: ms per decoding step")
    if builds:
        a, b = names
        print(f"context  float32 {a} / {b}  ratio  float16 {a} / {b}  ratio")
    else:
        print("context  float32  float16  f32/f16")
    for n in contexts:
        ms = {}
        rope = t.rope_table(n + 1, torch.float32)
        h = torch.randn(rows, blocks[0].D)
        for dtype in (torch.float32, torch.float16):
            shape = (c.n_kv_heads, n + 64, c.head_dim)
            caches = [
                [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(rows)]
                for _ in blocks
            ]
            pos = [n] * rows
            times = {name: [] for name in names}
            for rnd in range(rounds):
                outs = {}
                for name in names if rnd % 2 == 0 else names[::-1]:
                    if name is not None:
                        native._lib, native._tried = builds[name], True  # library() keeps it
                    for i in range(repeats + 1):  # the first, untimed, faults the pages in
                        if i == 1:
                            start = time.perf_counter()
                        outs[name] = [
                            native.attention_block(h, blk, rope, cache, pos)[0]
                            for blk, cache in zip(blocks, caches, strict=True)
                        ]
                    times[name].append((time.perf_counter() - start) / repeats * 1e3)
                if builds and not all(
                    torch.equal(u, v) for u, v in zip(*outs.values(), strict=True)
                ):
                    raise SystemExit(f"{n} positions, {dtype}: the builds differ in their bits")
            for name in names:
                ms[dtype, name] = statistics.median(times[name])
        if builds:
            line = f"{n:7d}"
            for dtype in (torch.float32, torch.float16):
                mine, other = ms[dtype, a], ms[dtype, b]
                line += f"  {mine:7.2f} / {other:7.2f}  {other / mine:5.2f}x"
            print(line, flush=True)
        else:
            f32, f16 = ms[torch.float32, None], ms[torch.float16, None]
            print(f"{n:7d}  {f32:7.2f}  {f16:7.2f}  {f32 / f16:6.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF (default: the demo MoE)")
    ap.add_argument("--workload", default="agentic")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--cache", type=float, default=0.5)
    ap.add_argument("--policies", default="bevy,sync")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--storage", choices=("ssd", "host"), default="ssd")
    ap.add_argument("--blocks", help="context lengths: time the attention blocks alone")
    ap.add_argument(
        "--against",
        type=Path,
        help="with --blocks: another tree's kernel sources (as q4_kernels.py takes them)",
    )
    args = ap.parse_args()
    if args.against and not args.blocks:
        ap.error("--against compares the attention blocks: give --blocks too")
    model = load_model(args.model or ensure_demo())
    if args.blocks:
        builds = None
        if args.against:
            import tempfile

            from backend.kernels import native

            out = Path(tempfile.mkdtemp(prefix="bevy-attn-"))
            builds = {
                "this tree": native.build(),
                "against": native.build(out, source=args.against),
            }
        time_blocks(model, args.requests, [int(n) for n in args.blocks.split(",")], builds)
        return
    prompts = prompts_for(model, args.workload, args.requests)
    refs = {}
    for kind in KINDS:
        model.transformer.set_kv_type(kind)
        refs[kind] = greedy_reference(model, prompts, args.tokens)
    runs = []
    for rnd in range(args.rounds):
        for kind in KINDS if rnd % 2 == 0 else KINDS[::-1]:
            for policy in args.policies.split(","):
                plan = BenchPlan(tokens=args.tokens, storage=args.storage, kv_type=kind)
                rec = run_once(model, policy, prompts, args.cache, plan)
                rec.update(kv_type=kind, exact=rec.pop("tokens") == refs[kind])
                runs.append(rec)
                print(
                    f"round {rnd + 1} {kind:4s} {policy:16s} {rec['tokens_per_s']:6.2f} tok/s"
                    f"  compute {rec['compute_busy_s']:5.2f} s  link {rec['link_busy_s']:5.2f} s"
                    f"  engine {rec['peak_engine_mib']:6.0f} MiB  exact {rec['exact']}",
                    flush=True,
                )
    print(
        f"\n{args.requests} {args.workload} requests, cache {args.cache:.0%}, {args.storage}, "
        f"{args.tokens} tokens, medians of {args.rounds}"
    )
    print("policy            f32 tok/s  f16 tok/s  f16/f32  engine MiB f32, f16  exact")
    for row in summarize(runs):
        print(
            f"{row['policy']:16s}  {row['auto']:9.2f}  {row['f16']:9.2f}  {row['ratio']:6.2f}x"
            f"  {row['auto_mib']:8.0f}, {row['f16_mib']:5.0f}  {row['exact']}"
        )


if __name__ == "__main__":
    main()
