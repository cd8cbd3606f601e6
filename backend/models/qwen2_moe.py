"""Qwen2-MoE: q/k/v biases and an always-on shared expert behind a sigmoid gate."""

from __future__ import annotations

from backend.formats.gguf import GGUFFile
from backend.models.common import Family, gguf_config, hf_config, hf_n_experts, hf_windows
from backend.models.config import ModelConfig


def from_hf(cfg: dict) -> ModelConfig:
    return hf_config(
        cfg,
        "qwen2_moe",
        n_experts=hf_n_experts(cfg),
        top_k=cfg["num_experts_per_tok"],
        expert_intermediate_size=cfg["moe_intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        attn_bias=True,
        shared_expert_size=cfg["shared_expert_intermediate_size"],
        # Configs older than ``layer_types``: every other layer below max_window_layers.
        **hf_windows(
            cfg, flagged=True, slides=lambda i: i % 2 == 0 and i < cfg.get("max_window_layers", 28)
        ),
    )


def from_gguf(g: GGUFFile) -> ModelConfig:
    return gguf_config(
        g,
        "qwen2_moe",
        expert_intermediate_size=int(g.get("expert_feed_forward_length")),
        norm_topk_prob=bool(g.get("expert_weights_norm", False)),
        attn_bias=True,
        shared_expert_size=int(g.get("expert_shared_feed_forward_length")),
    )


FAMILY = Family("qwen2_moe", ("Qwen2MoeForCausalLM",), ("qwen2moe",), from_hf, from_gguf)
