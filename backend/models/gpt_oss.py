"""gpt-oss: attention sinks, biases everywhere, every other layer sliding, YaRN, a router
that softmaxes its top-k logits, experts with the clamped SwiGLU.

Loaded from GGUF (llama.cpp's ``gpt-oss`` arch, MXFP4 experts in the published files).
Its Hugging Face checkpoints keep each layer's experts as one fused, transposed tensor
with gate and up interleaved (and, as published, in MXFP4 blocks), which no byte range
per expert can be cut from: the loader names the way there (a GGUF), and
``gguf_export.convert_gpt_oss`` writes one from a float checkpoint.
"""

from __future__ import annotations

from backend.formats.gguf import GGUFFile
from backend.models.common import Family, gguf_config, hf_config, hf_n_experts, hf_windows
from backend.models.config import ModelConfig

# What every gpt-oss has (llama.cpp hard-codes the SwiGLU's alpha 1.702 and limit 7.0).
_GPT_OSS = dict(
    attn_bias=True,
    attn_out_bias=True,
    attn_sinks=True,
    router_bias=True,
    router_softmax="topk",
    expert_act="swiglu_oai",
    expert_bias=True,
)

HF_REFUSAL = (
    "gpt-oss loads from GGUF: its Hugging Face checkpoint stores each layer's experts as one "
    "fused, transposed gate/up tensor that cannot be fetched one expert at a time. Use the "
    "GGUF file (llama.cpp's convert_hf_to_gguf.py writes one; LM Studio and Ollama publish them)."
)


def from_hf(cfg: dict) -> ModelConfig:
    raise ValueError(HF_REFUSAL)


def config_of_hf(cfg: dict) -> ModelConfig:
    """The config of a gpt-oss Hugging Face folder (for ``gguf_export.convert_gpt_oss``)."""
    return hf_config(
        cfg,
        "gpt_oss",
        n_experts=hf_n_experts(cfg),
        top_k=cfg["num_experts_per_tok"],
        expert_intermediate_size=cfg["intermediate_size"],
        norm_topk_prob=False,
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        **_GPT_OSS,
        **hf_windows(cfg),
    )


def from_gguf(g: GGUFFile) -> ModelConfig:
    n_layers = int(g.get("block_count"))
    # llama.cpp reads no window pattern for gpt-oss: even layers slide, odd ones attend fully.
    windows = {}
    if g.get("attention.sliding_window_pattern") is None:
        windows["window_layers"] = tuple(i % 2 == 0 for i in range(n_layers))
    return gguf_config(
        g,
        "gpt_oss",
        expert_intermediate_size=int(g.get("expert_feed_forward_length")),
        norm_topk_prob=False,
        **_GPT_OSS,
        **windows,
    )


FAMILY = Family(
    "gpt_oss",
    ("GptOssForCausalLM",),
    ("gpt-oss",),
    from_hf,
    from_gguf,
    gguf_renames={"ffn_norm": "post_attention_norm"},
)
