"""Llama (dense MLP). GGUF llama files store q/k permuted for adjacent-pair RoPE."""

from __future__ import annotations

from backend.formats.gguf import GGUFFile
from backend.models.common import Family, gguf_config, hf_config
from backend.models.config import ModelConfig


def from_hf(cfg: dict) -> ModelConfig:
    return hf_config(cfg, "llama", attn_bias=bool(cfg.get("attention_bias", False)))


def from_gguf(g: GGUFFile) -> ModelConfig:
    return gguf_config(
        g, "llama", rope_interleaved=True, attn_bias="blk.0.attn_q.bias" in g.tensors
    )


FAMILY = Family("llama", ("LlamaForCausalLM",), ("llama",), from_hf, from_gguf)
