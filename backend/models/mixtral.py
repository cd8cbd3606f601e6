"""Mixtral: every layer routed, top-k renormalised. In GGUF it is the ``llama`` arch with experts."""

from __future__ import annotations

from backend.formats.gguf import GGUFFile
from backend.models.common import Family, gguf_config, hf_config, hf_n_experts, hf_windows
from backend.models.config import ModelConfig


def from_hf(cfg: dict) -> ModelConfig:
    return hf_config(
        cfg,
        "mixtral",
        n_experts=hf_n_experts(cfg),
        top_k=cfg["num_experts_per_tok"],
        expert_intermediate_size=cfg["intermediate_size"],
        norm_topk_prob=True,
        **hf_windows(cfg),
    )


def from_gguf(g: GGUFFile) -> ModelConfig:
    ff = int(g.get("expert_feed_forward_length", 0) or g.get("feed_forward_length"))
    return gguf_config(
        g, "mixtral", rope_interleaved=True, expert_intermediate_size=ff, norm_topk_prob=True
    )


FAMILY = Family(
    "mixtral",
    ("MixtralForCausalLM",),
    ("llama",),
    from_hf,
    from_gguf,
    hf_moe_prefix="block_sparse_moe",
    hf_expert_names=("w1", "w3", "w2"),
)
