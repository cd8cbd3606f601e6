"""Tiny random HF models of every supported family, for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.08,
    rms_norm_eps=1e-6,
)

FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    # One dense layer in the middle exercises mixed dense/sparse stacks.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "head_dim": 16,
            "mlp_only_layers": [1],
            "norm_topk_prob": True,
        },
    ),
    "olmoe": (
        "OlmoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "num_key_value_heads": 4,
        },
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
    ),
    # Layers 0 and 2 slide (its default ``layer_types``); YaRN with llama.cpp's rounded ramp.
    "gpt_oss": (
        "GptOssConfig",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "head_dim": 16,
            "sliding_window": 5,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "truncate": True,
            },
        },
    ),
    # Gated DeltaNet layers 0 and 2, gated attention layers 1 and 3 (full_attention_interval
    # 2); three linear value heads per key head (not as many as key heads), so that their
    # tiled order in GGUF, and which way it is undone, matters.
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        {
            "num_hidden_layers": 4,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 6,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "layer_types": ["linear_attention", "full_attention"] * 2,
        },
    ),
    # Sliding layers 0 and 2 (16-wide heads, 2 KV heads, window 6) and full layers 1 and 3
    # (32-wide heads, 1 KV head, values from the keys' projection, proportional RoPE on a
    # quarter of the pairs); experts beside the dense MLP; tied embeddings as published; a
    # soft cap low enough to bend these logits.
    "gemma4": (
        "Gemma4TextConfig",
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "hidden_size_per_layer_input": 0,
            "enable_moe_block": True,
            "num_experts": 8,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
            "final_logit_softcapping": 3.0,
            "tie_word_embeddings": True,
        },
    ),
}


def make_tiny(family: str, folder: Path, **overrides: object) -> Path:
    """A tiny random ``family`` model saved to ``folder``; ``overrides`` replace config
    fields (``rope_parameters``, ``sliding_window``, ...)."""
    import transformers

    cls, extra = FAMILY_CONFIGS[family]
    fields = {"tie_word_embeddings": False, **TINY, **extra, **overrides}
    config = getattr(transformers, cls)(**fields)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Norm weights start at 1; jitter them so a missed norm cannot go unnoticed.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if "bias" in name:
                p.normal_(0, 0.1)
            if family == "gpt_oss" and name.endswith("sinks"):  # a real share of the softmax
                p.normal_(0, 1.0)
            if family == "gpt_oss" and name.endswith("gate_up_proj"):  # past the clamp (7)
                p.normal_(0, 1.5)
            if family == "gemma4" and name.endswith(("router.scale", "per_expert_scale")):
                p.add_(torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # (ones as initialized: make them count)
                b.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


def hf_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of ``ids`` (the reference)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def make_tiny_chat(family: str, folder: Path, tokenizer_gguf: Path) -> Path:
    """A tiny random model that speaks through SmolLM2's real tokenizer and chat template."""
    import json

    from backend.formats.gguf import read_gguf
    from backend.text.tokenizer import Tokenizer

    meta = read_gguf(tokenizer_gguf).metadata
    tok = Tokenizer.from_gguf_metadata(meta, tokenizer_gguf)
    saved = dict(TINY)
    TINY.update(vocab_size=tok.vocab_size, max_position_embeddings=8192)
    try:
        make_tiny(family, folder)
    finally:
        TINY.clear()
        TINY.update(saved)
    tok.backend.save(str(folder / "tokenizer.json"))
    config = {
        "chat_template": tok.chat_template,
        "eos_token": tok.id_to_token(min(tok.eos_ids)),
        "bos_token": None,
        "add_bos_token": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def as_multimodal(
    folder: Path, out: Path, text: dict[str, torch.Tensor], beside: dict, config: dict
) -> Path:
    """The text model of ``folder`` laid out as a published multimodal checkpoint in
    ``out``: ``text`` (its tensors, named under "model.") under "model.language_model.",
    the towers' ``beside`` next to them, config.json ``config`` with the folder's own
    config as its ``text_config``."""
    import json

    from safetensors.torch import save_file

    hub = dict(beside)
    for name, t in text.items():
        hub[name.replace("model.", "model.language_model.", 1)] = t
    out.mkdir()
    save_file(hub, out / "model.safetensors")
    own = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "text_config": own}))
    return out
