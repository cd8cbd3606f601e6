"""GPU memory under ``--memory``: what the engine's allocations reach against the budget.

    python benchmarks/cuda_memory.py [--layers 8] [--memory 700MiB,800MiB,1000MiB,1.5GiB]

On a random MoE of the demo's expert shape (``cuda_moe.build``: hidden 576, 32 experts of
1536 per layer, top-4, Q4_1), for each budget: an engine with that ``--memory`` (cache
"auto", experts in pinned RAM) decodes 8 short prompts, then reads one long prompt beside
4 more. Prints the plan, torch's peak allocated and reserved device memory (the pool the
budget bounds; the CUDA context is the driver's, outside it) and tokens/s. Needs
transformers (the test extra) to make the random model.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_moe import build  # noqa: E402

from backend.config import EngineConfig, SamplingParams  # noqa: E402
from backend.engine.loop import Engine  # noqa: E402
from backend.messages import ErrorEvent, Finished, Submit  # noqa: E402
from backend.models.loader import LoadedModel, load_model  # noqa: E402


def run(model: LoadedModel, memory: str, args: argparse.Namespace) -> None:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        eng = Engine(model, EngineConfig(device="cuda", storage="host", memory=memory))
    except ValueError as exc:  # too small for the model: the engine says what it needs
        print(f"--memory {memory}: {exc}", flush=True)
        return
    plan = eng.memory_plan
    tokens = 0
    try:
        gen = torch.Generator().manual_seed(1)
        talk = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        t0 = time.perf_counter()
        for i in range(args.requests):
            eng.submit(
                Submit(
                    f"c{i}", talk, prompt_ids=torch.randint(0, 2048, (16,), generator=gen).tolist()
                )
            )
        eng.run_until_idle(600)
        long = torch.randint(0, 2048, (args.prompt_tokens,), generator=gen).tolist()
        eng.submit(Submit("long", one, prompt_ids=long))
        for i in range(args.requests // 2):
            eng.submit(
                Submit(
                    f"b{i}", talk, prompt_ids=torch.randint(0, 2048, (16,), generator=gen).tolist()
                )
            )
        eng.run_until_idle(600)
        wall = time.perf_counter() - t0
        errors = []
        while not eng.events.empty():
            e = eng.events.get()
            if isinstance(e, Finished):
                tokens += len(e.token_ids)
            elif isinstance(e, ErrorEvent):
                errors.append(e.message)
        failed = f" {len(errors)} FAILED: {errors[0]:.200}" if errors else ""
    except Exception as exc:  # an out-of-memory is what this measures
        wall, failed = float("nan"), f" FAILED: {exc!r:.200}"
    finally:
        eng.close()
    mib = 1 << 20
    print(
        f"--memory {memory}: {plan.note}; KV {plan.kv_bytes // mib} MiB\n"
        f"  peak allocated {torch.cuda.max_memory_allocated() // mib} MiB, "
        f"peak reserved {torch.cuda.max_memory_reserved() // mib} MiB "
        f"of {plan.total_bytes // mib} MiB; {tokens / wall:.1f} tok/s{failed}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--memory", default="700MiB,800MiB,1000MiB,1.5GiB")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(build(Path(tmp), args.layers), device="cuda")
        for memory in args.memory.split(","):
            run(model, memory, args)


if __name__ == "__main__":
    main()
