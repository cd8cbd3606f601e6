"""The embedded demo MoE: built once per run into the platform cache dir."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backend.bench.cachesim import lfu_hit_rate
from backend.bench.workloads import load_workload
from backend.demo import build as demo
from backend.formats.gguf import read_gguf
from backend.models.generate import chat_prompt_ids, greedy_reference
from backend.models.loader import load_model

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    return demo.ensure_demo(quiet=True)


def test_demo_is_a_llama_cpp_style_moe(demo_gguf: Path, smollm2_gguf: Path) -> None:
    g = read_gguf(demo_gguf)
    assert g.arch == "llama"
    assert g.metadata["llama.expert_count"] == 32 and g.metadata["llama.expert_used_count"] == 4
    base = read_gguf(smollm2_gguf)
    for layer in (0, 29):
        gate = g.tensors[f"blk.{layer}.ffn_gate_exps.weight"]
        assert gate.shape == (32, 1536, 576) and gate.qtype.name == "Q4_1"
        assert g.tensors[f"blk.{layer}.ffn_gate_inp.weight"].shape == (32, 576)
    model = load_model(demo_gguf)
    assert model.config.family == "mixtral" and model.config.n_routed_experts == 960
    # Each expert's bytes are the dense MLP's Q4_1 blocks, as stored.
    dense = base.tensors["blk.7.ffn_down.weight"]
    with open(dense.path, "rb") as f:
        f.seek(dense.offset)
        want = f.read(dense.nbytes)
    for e in (0, 31):
        ref = model.experts[7][e].down
        with open(ref.path, "rb") as f:
            f.seek(ref.offset)
            assert f.read(ref.nbytes) == want


def test_demo_matches_dense_greedy(demo_gguf: Path, smollm2_gguf: Path) -> None:
    moe, dense = load_model(demo_gguf), load_model(smollm2_gguf)
    chats = [r["messages"] for r in load_workload("chat")[:5]]
    prompts = [chat_prompt_ids(dense, m) for m in chats]
    assert prompts == [chat_prompt_ids(moe, m) for m in chats]
    # The experts dequantized, as the dense model's MLP is multiplied in float: the native
    # expert kernels round their inputs to 8 bits (as llama.cpp's do), the dense ones not.
    experts = moe.resident_experts().for_compute
    assert greedy_reference(moe, prompts, 32, experts) == greedy_reference(dense, prompts, 32)


def test_router_skew_matches_the_paper(demo_gguf: Path, smollm2_gguf: Path) -> None:
    """An LFU cache of 30 % of experts hits 50-60 % of expert uses on the chat prompts."""
    xs = demo._calibration_inputs(smollm2_gguf)
    model = load_model(demo_gguf)
    picks = [
        (x @ model.transformer.w[f"blk.{i}.ffn_gate_inp"].T).topk(4, dim=-1).indices
        for i, x in enumerate(xs)
    ]
    rate = lfu_hit_rate(demo._uses(picks), round(0.3 * 960))
    print(f"LFU 30 % hit rate on the chat prompts: {rate:.1%}")
    assert 0.50 <= rate <= 0.60
    # Popularity is skewed but no expert is dead: every (layer, expert) is picked.
    counts = torch.stack([torch.bincount(p.flatten(), minlength=32) for p in picks])  # [L, E]
    assert (counts > 0).all()
    assert counts.max() > 20 * counts.min()


def test_bevy_generate_answers_paris(demo_gguf: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "backend.serving.cli",
            "generate",
            "--model",
            str(demo_gguf),
            "--temperature",
            "0",
            "--max-tokens",
            "24",
            # (asked "What is the capital of France?", this 135M Q4_1 model answers in
            # French with 8-bit activations, llama.cpp's server on the same file too)
            "Name the capital of France.",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
