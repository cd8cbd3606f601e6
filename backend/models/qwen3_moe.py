"""Qwen3-MoE: per-head q/k RMSNorm, softmax-then-top-k routing with norm_topk_prob."""

from __future__ import annotations

from backend.formats.gguf import GGUFFile
from backend.models.common import Family, gguf_config, hf_config, hf_n_experts, hf_windows
from backend.models.config import ModelConfig


def from_hf(cfg: dict) -> ModelConfig:
    return hf_config(
        cfg,
        "qwen3_moe",
        n_experts=hf_n_experts(cfg),
        top_k=cfg["num_experts_per_tok"],
        expert_intermediate_size=cfg["moe_intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        qk_norm="head",
        attn_bias=bool(cfg.get("attention_bias", False)),
        **hf_windows(cfg, flagged=True),
    )


def from_gguf(g: GGUFFile) -> ModelConfig:
    # llama.cpp hard-codes the renormalisation for qwen3moe (no metadata key).
    return gguf_config(
        g,
        "qwen3_moe",
        expert_intermediate_size=int(g.get("expert_feed_forward_length")),
        norm_topk_prob=bool(g.get("expert_weights_norm", True)),
        qk_norm="head",
        attn_bias="blk.0.attn_q.bias" in g.tensors,
    )


FAMILY = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3moe",), from_hf, from_gguf)
