"""What constrained decoding costs the engine: decode tokens/s of N concurrent chat
requests with a JSON schema on half of them against none, side by side, and the time
each mask took to compute and the sampler waited for it.

    python benchmarks/grammar_cost.py [--requests 8] [--tokens 64] [--cache 0.7] [--rounds 2]

Runs on the demo MoE (built on first use), policy bevy, experts from the SSD. The
schema asks for a long array of short strings, so constrained replies run to
``--tokens`` like the free ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.bench.runner import prompts_for  # noqa: E402
from backend.config import EngineConfig, Grammar, SamplingParams  # noqa: E402
from backend.demo.build import ensure_demo  # noqa: E402
from backend.engine.loop import Engine, short_switch_interval  # noqa: E402
from backend.messages import ErrorEvent, Submit, TokenEvent  # noqa: E402
from backend.models.loader import load_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 40,
            "maxItems": 40,
        }
    },
    "required": ["notes"],
    "additionalProperties": False,
}


def run(model, prompts: list[list[int]], args: argparse.Namespace, constrained: int) -> dict:
    config = EngineConfig(policy="bevy", cache=args.cache, storage="ssd", metrics_interval_s=3600)
    eng = Engine(model, config)
    short_switch_interval()
    free = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    json_params = SamplingParams(
        temperature=0,
        max_tokens=args.tokens,
        ignore_eos=True,
        grammar=Grammar("json_schema", json.dumps(SCHEMA)),
    )
    for i, p in enumerate(prompts):
        params = json_params if i < constrained else free
        eng.submit(Submit(f"r{i}", params, prompt_ids=p))
    eng._drain(block=False)
    grammars = [r.grammar for r in eng.waiting if r.grammar is not None]
    tokens = {f"r{i}": 0 for i in range(len(prompts))}
    mark = None
    try:
        while eng.has_work:
            eng.step()
            while not eng.events.empty():
                ev = eng.events.get()
                if isinstance(ev, ErrorEvent):
                    raise RuntimeError(ev.message)
                if isinstance(ev, TokenEvent) and ev.token_id >= 0:
                    tokens[ev.request_id] += 1
            if mark is None and all(tokens.values()):
                mark = (time.perf_counter(), sum(tokens.values()))
        end = time.perf_counter()
    finally:
        eng.close()
    t0, n0 = mark
    steps = sum(g.steps for g in grammars)
    return {
        "tokens_per_s": (sum(tokens.values()) - n0) / (end - t0),
        "mask_ms_per_step": 1e3 * sum(g.mask_s for g in grammars) / steps if steps else 0.0,
        "wait_ms_per_step": 1e3 * sum(g.wait_s for g in grammars) / steps if steps else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--cache", default="0.7")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = load_model(ensure_demo())
    prompts = prompts_for(model, "chat", args.requests)
    results: dict[int, list[dict]] = {0: [], args.requests // 2: []}
    for _ in range(args.rounds):
        for constrained in results:
            results[constrained].append(run(model, prompts, args, constrained))
    base = statistics.median(r["tokens_per_s"] for r in results[0])
    for constrained, runs in results.items():
        tps = statistics.median(r["tokens_per_s"] for r in runs)
        line = f"{constrained} of {args.requests} constrained: {tps:.2f} tok/s (x{tps / base:.3f})"
        if constrained:
            mask = statistics.median(r["mask_ms_per_step"] for r in runs)
            wait = statistics.median(r["wait_ms_per_step"] for r in runs)
            line += f"; mask {mask:.2f} ms per step, sampler waited {wait:.3f} ms"
        print(line, " | runs:", ", ".join(f"{r['tokens_per_s']:.2f}" for r in runs), flush=True)


if __name__ == "__main__":
    main()
