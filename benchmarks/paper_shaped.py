"""`bevy bench` on a random model shaped like the paper's Qwen3.6-35B-A3B, scaled to run
in minutes on two cores.

    python benchmarks/paper_shaped.py [--layers 12] [--experts 64] [--top-k 8]
        [--hidden 512] [--expert-width 512] [--qtype Q4_0] [bench options ...]

The model is Qwen3.5-MoE's hybrid stack (three Gated DeltaNet layers to one gated
attention layer, partial RoPE, routed experts plus a shared one) with random weights, the
initialisation transformers gives it, and SmolLM2's vocabulary so that the bundled chat
and agentic prompts tokenize. It is built once into the cache dir (``bench/``), then
every other argument goes to ``bevy bench`` (default: the four policies, chat and agentic,
8 requests, 30 % and 50 % caches, 32 tokens).

Its routers are random, so expert choices are close to uniform: a cache of a fraction F
of the experts hits about F of uses, less than real routing locality gives (the demo MoE
is calibrated to the paper's 54 % at 30 %). It measures the engine on the paper's shape,
not the paper's hit rates.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.demo.source import ensure_base_gguf  # noqa: E402
from backend.kernels.quants import QType  # noqa: E402
from backend.models.common import expected_shapes  # noqa: E402
from backend.models.config import ModelConfig  # noqa: E402
from backend.models.gguf_export import _write  # noqa: E402
from backend.paths import cache_dir  # noqa: E402

VOCAB = 49152  # SmolLM2's


def shape(args: argparse.Namespace) -> ModelConfig:
    """Qwen3.6-35B-A3B's proportions at ``--hidden``: head 1/8 of it, a quarter rotary,
    linear heads of the same width, every fourth layer full attention."""
    head = args.hidden // 8
    return ModelConfig(
        family="qwen3_5_moe",
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        n_layers=args.layers,
        n_heads=8,
        n_kv_heads=2,
        head_dim=head,
        intermediate_size=0,
        rms_eps=1e-6,
        rope_theta=1e7,
        rotary_dim=head // 4,
        context_length=8192,
        n_experts=args.experts,
        top_k=args.top_k,
        expert_intermediate_size=args.expert_width,
        shared_expert_size=args.expert_width,
        qk_norm="head",
        attn_gate=True,
        linear_layers=tuple((i + 1) % 4 != 0 for i in range(args.layers)),
        linear_k_heads=4,
        linear_v_heads=8,
        linear_k_dim=head,
        linear_v_dim=head,
        conv_kernel=4,
    )


def random_weights(c: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """transformers' initialisation: normal(0, 0.02) projections, unit norms, A in
    (0.01, 16) (stored as -A), dt bias 1, the conv's default uniform."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, dims in expected_shapes(c).items():
        base = name.split(".")[-1] if not name.endswith(".bias") else name.split(".")[-2]
        if "norm" in base:
            t = torch.ones(dims)
        elif base == "ssm_a":
            t = -(torch.rand(dims, generator=gen) * 15.99 + 0.01)
        elif base == "ssm_dt":
            t = torch.ones(dims)
        elif base == "ssm_conv1d":
            t = (torch.rand(dims, generator=gen) - 0.5) * (2 / c.conv_kernel**0.5)
        else:
            t = torch.randn(dims, generator=gen) * 0.02
        out[name] = t
    return out


def build(args: argparse.Namespace) -> Path:
    c = shape(args)
    name = (
        f"qwen35moe-paper-shaped-L{c.n_layers}-E{c.n_experts}-K{c.top_k}"
        f"-D{c.hidden_size}-I{c.expert_intermediate_size}.{args.qtype}.gguf"
    )
    path = cache_dir() / "bench" / name
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(f"building {path.name} (once) ...", file=sys.stderr, flush=True)
    gen = torch.Generator().manual_seed(1)
    I, D = c.expert_intermediate_size, c.hidden_size

    def experts(layer: int) -> list:
        return [
            tuple(torch.randn(s, generator=gen) * 0.02 for s in ((I, D), (I, D), (D, I)))
            for _ in range(c.n_experts)
        ]

    part = path.with_name(path.name + ".part")
    _write(c, random_weights(c), experts, part, QType[args.qtype], ensure_base_gguf(quiet=True))
    part.replace(path)
    size = path.stat().st_size / 1e9
    print(f"built {path} ({size:.2f} GB) in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert-width", type=int, default=512)
    ap.add_argument("--qtype", default="Q4_0", choices=["Q4_0", "Q4_1", "Q8_0"])
    args, bench = ap.parse_known_args()
    path = build(args)
    from backend.serving.cli import main as bevy

    defaults = {
        "--policies": "bevy,sync,prefetch-gate,prefetch-history",
        "--workload": "chat,agentic",
        "--requests": "8",
        "--cache": "0.3,0.5",
        "--tokens": "32",
    }
    for flag, value in defaults.items():
        if flag not in bench:
            bench += [flag, value]
    return bevy(["bench", "--model", str(path), *bench])


if __name__ == "__main__":
    sys.exit(main())
