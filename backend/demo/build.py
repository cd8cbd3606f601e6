"""The embedded demo MoE: SmolLM2-135M-Instruct upcycled into a 32-expert, top-4 Mixtral.

Every layer's dense MLP is copied into 32 experts (its Q4_1 blocks kept as stored), with
Mixtral routing (softmax over the top-k, renormalised), so the MoE computes exactly what
the dense model computes whatever the router picks; only which bytes are read changes.

The router is a seeded random projection plus a per-expert bias that skews expert
popularity like a trained router's. llama-arch GGUFs have no router bias tensor, so the
bias is folded into the weights along the layer's mean router input ``mu``:
``W = R + b (mu / |mu|^2)^T`` gives ``W x = R x + b (mu . x / |mu|^2) ~ R x + b``.
The bias scale is found by bisection so that an LFU cache holding 30 % of all experts
hits ``TARGET_LFU30`` of expert uses on the bundled chat prompts (the paper: 54.1 %).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from backend.bench.cachesim import lfu_hit_rate
from backend.demo.source import ensure_base_gguf
from backend.paths import cache_dir

N_EXPERTS = 32
TOP_K = 4
SEED = 2611
TARGET_LFU30 = 0.55
VERSION = 1
DEMO_NAME = f"SmolLM2-135M-Instruct-MoE-{N_EXPERTS}x{TOP_K}.Q4_1.gguf"


def demo_path() -> Path:
    return cache_dir() / "demo" / DEMO_NAME


@dataclass
class BuildReport:
    path: Path
    seconds: float
    size_bytes: int
    lfu30_hit_rate: float
    bias_scale: float
    calibration_tokens: int


def _calibration_inputs(base: Path) -> list[torch.Tensor]:
    """Per layer, the router inputs (post-ffn_norm hidden states) of the bundled chat prompts."""
    from backend.bench.workloads import load_workload
    from backend.models.generate import chat_prompt_ids
    from backend.models.loader import load_model
    from backend.models.transformer import KVCache, SeqSlice

    model = load_model(base)
    t = model.transformer
    per_layer: list[list[torch.Tensor]] = [[] for _ in range(model.config.n_layers)]
    with torch.inference_mode():
        for record in load_workload("chat"):
            ids = chat_prompt_ids(model, record["messages"])
            seq = [SeqSlice(KVCache(model.config.n_layers), 0, len(ids))]
            h = t.embed(torch.tensor(ids))
            for layer in range(model.config.n_layers):
                h = t.attention_block(layer, h, seq)
                x = t.ffn_input(layer, h)
                per_layer[layer].append(x)
                h = h + t.dense_mlp(layer, x)
    return [torch.cat(xs) for xs in per_layer]


def _routers(xs: list[torch.Tensor], scale: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Router weights [E, D] per layer for bias ``scale``, and the top-k ids they pick [T, K]."""
    gen = torch.Generator().manual_seed(SEED)
    # Popularity profile: normal quantiles, a different expert order in every layer.
    quantiles = torch.tensor(
        [
            math.sqrt(2) * torch.special.erfinv(torch.tensor(1 - 2 * (i + 0.5) / N_EXPERTS)).item()
            for i in range(N_EXPERTS)
        ]
    )
    weights, picks = [], []
    for x in xs:
        D = x.shape[1]
        mu = x.mean(0)
        r = torch.randn(N_EXPERTS, D, generator=gen)
        # Remove the mean direction from the random part: hidden states share a large common
        # component, which would otherwise act as an uncontrolled random bias.
        r = r - (r @ mu)[:, None] * (mu / mu.dot(mu))[None, :]
        r = r / (x @ r.T).std()  # unit-variance random logits on real inputs
        bias = quantiles[torch.randperm(N_EXPERTS, generator=gen)] * scale
        w = r + bias[:, None] * (mu / mu.dot(mu))[None, :]
        weights.append(w)
        picks.append((x @ w.T).topk(TOP_K, dim=-1).indices)
    return weights, picks


def _uses(picks: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Expert uses in the order a token-by-token run would make them."""
    stacked = torch.stack(picks, dim=1)  # [T, L, K]
    T, L, K = stacked.shape
    flat = stacked.reshape(-1).tolist()
    return [((i // K) % L, flat[i]) for i in range(T * L * K)]


def calibrate(
    xs: list[torch.Tensor], capacity_frac: float = 0.3, target: float = TARGET_LFU30
) -> tuple[float, float, list[torch.Tensor]]:
    """Bisection on the bias scale; returns (scale, LFU hit rate, router weights)."""
    capacity = round(capacity_frac * N_EXPERTS * len(xs))
    lo, hi = 0.0, 8.0
    best = None
    for _ in range(14):
        mid = (lo + hi) / 2
        weights, picks = _routers(xs, mid)
        rate = lfu_hit_rate(_uses(picks), capacity)
        if best is None or abs(rate - target) < abs(best[1] - target):
            best = (mid, rate, weights)
        if abs(rate - target) < 0.005:
            break
        lo, hi = (mid, hi) if rate < target else (lo, mid)
    assert best is not None
    return best


def build_demo(out: Path | None = None, quiet: bool = False) -> BuildReport:
    """Build the demo MoE GGUF (about 1.6 GB) next to the cached base model."""
    t0 = time.perf_counter()
    out = out or demo_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    base = ensure_base_gguf(quiet=quiet)
    log = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))
    log(f"Calibrating routers on the bundled chat prompts ({base.name}) ...")
    xs = _calibration_inputs(base)
    scale, rate, routers = calibrate(xs)
    log(
        f"Router bias scale {scale:.3f}: an LFU cache of 30 % of experts hits {rate:.1%} of expert uses"
    )
    reader = gguf.GGUFReader(base, "r")
    partial = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(partial, "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.name"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    writer.add_name(f"SmolLM2 135M Instruct MoE {N_EXPERTS}x{TOP_K} (Bevy demo, upcycled)")
    writer.add_expert_count(N_EXPERTS)
    writer.add_expert_used_count(TOP_K)
    writer.add_uint32("bevy.demo.version", VERSION)
    writer.add_uint32("bevy.demo.seed", SEED)
    writer.add_float32("bevy.demo.lfu30_hit_rate", rate)
    for t in reader.tensors:
        name = t.name
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            layer, kind = int(parts[1]), parts[2]
            data = np.broadcast_to(t.data, (N_EXPERTS, *t.data.shape))
            writer.add_tensor(f"blk.{layer}.{kind}_exps.weight", data, raw_dtype=t.tensor_type)
            if kind == "ffn_gate":
                writer.add_tensor(
                    f"blk.{layer}.ffn_gate_inp.weight", routers[layer].numpy().astype(np.float32)
                )
        else:
            writer.add_tensor(name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=not quiet)
    writer.close()
    partial.replace(out)
    report = BuildReport(
        out, time.perf_counter() - t0, out.stat().st_size, rate, scale, int(xs[0].shape[0])
    )
    log(f"Built {out} ({report.size_bytes / 1e9:.2f} GB) in {report.seconds:.1f} s")
    return report


def demo_version(path: Path) -> int | None:
    from backend.errors import ModelLoadError
    from backend.formats.gguf import read_gguf

    try:
        version = read_gguf(path).metadata.get("bevy.demo.version")
    except ModelLoadError:
        return None
    return int(version) if version is not None else None


def demo_is_built() -> bool:
    """Whether the demo MoE is in the cache, built by this recipe."""
    path = demo_path()
    return path.exists() and demo_version(path) == VERSION


def ensure_demo(quiet: bool = False) -> Path:
    """The demo MoE's path, building it on first use (or when the recipe changed)."""
    if demo_is_built():
        return demo_path()
    return build_demo(demo_path(), quiet=quiet).path
