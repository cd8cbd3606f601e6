"""The accelerator's MoE path with and without grouping, side by side, on a random MoE of
the demo's expert shape (hidden 576, 32 experts of 1536, top-4, Q4_1).

    python benchmarks/cuda_moe.py [--device cuda] [--layers 2] [--requests 8] [--tokens 16]

For each policy, runs alternate between the ``grouped`` expert backend (a job's experts
decoded and multiplied together) and ``eager`` (expert by expert), with the host tier. Prints
tokens/s (prefill included: the prompts are short) and whether both gave the same tokens.
Needs transformers (the test extra) to make the random model.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from backend.config import EngineConfig, SamplingParams
from backend.engine.loop import Engine
from backend.kernels.quants import QType
from backend.messages import Finished, Submit
from backend.models.gguf_export import write_gguf
from backend.models.loader import LoadedModel, load_model


def build(folder: Path, layers: int) -> Path:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=2048,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_local_experts=32,
        num_experts_per_tok=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder / "hf")
    return write_gguf(load_model(folder / "hf"), folder / "moe.q4_1.gguf", QType.Q4_1)


def run(
    model: LoadedModel, args: argparse.Namespace, policy: str, grouped: bool
) -> tuple[float, dict[str, list[int]]]:
    config = EngineConfig(
        device=args.device,
        policy=policy,
        cache=args.cache,
        storage="host",
        expert_backend="grouped" if grouped else "eager",
    )
    eng = Engine(model, config)
    try:
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        gen = torch.Generator().manual_seed(1)
        for i in range(args.requests):
            prompt = torch.randint(0, 2048, (16,), generator=gen).tolist()
            eng.submit(Submit(f"r{i}", params, prompt_ids=prompt))
        t0 = time.perf_counter()
        eng.run_until_idle(600)
        wall = time.perf_counter() - t0
        done = {}
        while not eng.events.empty():
            e = eng.events.get()
            if isinstance(e, Finished):
                done[e.request_id] = list(e.token_ids)
        assert sum(eng.cache.refs) == 0
        return sum(len(t) for t in done.values()) / wall, done
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--cache", default="0.3")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--policies", default="bevy,sync")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model = load_model(build(Path(tmp), args.layers), device=args.device)
        print(f"model built and loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        for policy in args.policies.split(","):
            speed: dict[bool, list[float]] = {True: [], False: []}
            tokens: dict[bool, dict] = {}
            for _ in range(args.rounds):
                for grouped in (True, False):
                    tps, tokens[grouped] = run(model, args, policy, grouped)
                    speed[grouped].append(tps)
            new, old = statistics.median(speed[True]), statistics.median(speed[False])
            print(
                f"{policy}: grouped {new:.2f} tok/s, per-expert {old:.2f} tok/s, "
                f"x{new / old:.2f}, same tokens: {tokens[True] == tokens[False]}",
                flush=True,
            )


if __name__ == "__main__":
    main()
