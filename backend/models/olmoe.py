"""OLMoE: q/k RMSNorm over the whole projection (before splitting heads), no top-k renormalisation."""

from __future__ import annotations

from backend.formats.gguf import GGUFFile
from backend.models.common import Family, gguf_config, hf_config, hf_n_experts
from backend.models.config import ModelConfig


def from_hf(cfg: dict) -> ModelConfig:
    return hf_config(
        cfg,
        "olmoe",
        n_experts=hf_n_experts(cfg),
        top_k=cfg["num_experts_per_tok"],
        expert_intermediate_size=cfg["intermediate_size"],
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        qk_norm="full",
        clip_qkv=cfg.get("clip_qkv"),
    )


def from_gguf(g: GGUFFile) -> ModelConfig:
    # The converter writes no expert width key: experts use feed_forward_length.
    return gguf_config(
        g,
        "olmoe",
        expert_intermediate_size=int(
            g.get("expert_feed_forward_length", 0) or g.get("feed_forward_length")
        ),
        norm_topk_prob=bool(g.get("expert_weights_norm", False)),
        qk_norm="full",
    )


FAMILY = Family("olmoe", ("OlmoeForCausalLM",), ("olmoe",), from_hf, from_gguf)
