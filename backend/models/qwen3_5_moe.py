"""Qwen3.5/3.6-MoE: a hybrid stack of Gated DeltaNet layers (``linear_attention``) and,
every fourth layer by default, gated softmax attention (q_proj also writes a sigmoid gate
per head; per-head q/k RMSNorm; RoPE on the first quarter of each head); every layer's MLP
is 256-ish routed experts (softmax, top-k, renormalized) plus a sigmoid-gated shared
expert. Its RMSNorms scale by (1 + weight): llama.cpp's converter stores 1 + weight in
GGUF, and we add the 1 when reading a Hugging Face folder.

In llama.cpp's GGUF (arch ``qwen35moe``) the value heads of the linear layers are stored
tiled ([K0, K1, ..., K0, K1, ...] by key head) rather than grouped by key head as
transformers keeps them; the loader puts them back in transformers' order.
"""

from __future__ import annotations

import torch

from backend.formats.gguf import GGUFFile
from backend.models.common import Family, gguf_config, hf_config, hf_n_experts
from backend.models.config import ModelConfig

_SHARED = dict(norm_topk_prob=True, qk_norm="head", attn_gate=True)
# The norms transformers computes as x * (1 + w): every one but the linear layers' ssm_norm.
_CENTERED = ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "output_norm")


def from_hf(cfg: dict) -> ModelConfig:
    if "text_config" in cfg:  # the multimodal checkpoint: its text model's config
        cfg = {**cfg, **cfg["text_config"]}
    n_layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0 else "linear"
        for i in range(n_layers)
    ]
    return hf_config(
        cfg,
        "qwen3_5_moe",
        n_experts=hf_n_experts(cfg),
        top_k=cfg["num_experts_per_tok"],
        expert_intermediate_size=cfg["moe_intermediate_size"],
        shared_expert_size=cfg.get("shared_expert_intermediate_size", 0),
        attn_bias=bool(cfg.get("attention_bias", False)),
        linear_layers=tuple(t != "full_attention" for t in types),
        linear_k_heads=cfg["linear_num_key_heads"],
        linear_v_heads=cfg["linear_num_value_heads"],
        linear_k_dim=cfg["linear_key_head_dim"],
        linear_v_dim=cfg["linear_value_head_dim"],
        conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
        **_SHARED,
    )


def from_gguf(g: GGUFFile) -> ModelConfig:
    # llama.cpp's converter keeps the multi-token-prediction block as the last
    # ``nextn_predict_layers`` blocks (named like the others); generation never runs it.
    n_layers = int(g.get("block_count")) - int(g.get("nextn_predict_layers", 0) or 0)
    recurrent = g.get("attention.recurrent_layers")
    if recurrent is None:
        every = int(g.get("full_attention_interval", 4) or 4)
        recurrent = [(i + 1) % every != 0 for i in range(n_layers)]
    recurrent = list(recurrent)[:n_layers]
    # llama.cpp reads one head width for keys and values of the linear layers.
    width = int(g.get("ssm.state_size", 0) or 0)
    v_heads = int(g.get("ssm.time_step_rank", 0) or 0)
    inner = int(g.get("ssm.inner_size", 0) or 0)
    if inner != width * v_heads:
        raise ValueError(f"ssm.inner_size {inner} is not ssm.state_size x ssm.time_step_rank")
    return gguf_config(
        g,
        "qwen3_5_moe",
        n_layers=n_layers,
        expert_intermediate_size=int(g.get("expert_feed_forward_length")),
        shared_expert_size=int(g.get("expert_shared_feed_forward_length", 0) or 0),
        linear_layers=tuple(bool(b) for b in recurrent),
        linear_k_heads=int(g.get("ssm.group_count", 0) or 0),
        linear_v_heads=v_heads,
        linear_k_dim=width,
        linear_v_dim=width,
        conv_kernel=int(g.get("ssm.conv_kernel", 0) or 0),
        **_SHARED,
    )


def swap_heads(t: torch.Tensor, dim: int, outer: int, inner: int, width: int) -> torch.Tensor:
    """``t`` with its axis ``dim`` (outer x inner heads of ``width``) reordered to inner x
    outer: grouped -> tiled with (key heads, values per key head), back with the two swapped."""
    shape = list(t.shape)
    split = t.reshape(*shape[:dim], outer, inner, width, *shape[dim + 1 :])
    return split.transpose(dim, dim + 1).reshape(shape)


def value_heads_axes(c: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """Linear layers' tensors with value heads along an axis: base name -> (axis, offset
    into it where the value heads start, head width)."""
    qk = 2 * c.linear_k_heads * c.linear_k_dim
    return {
        "attn_qkv": (0, qk, c.linear_v_dim),
        "ssm_conv1d": (0, qk, c.linear_v_dim),
        "attn_gate": (0, 0, c.linear_v_dim),
        "ssm_beta": (0, 0, 1),
        "ssm_alpha": (0, 0, 1),
        "ssm_a": (0, 0, 1),
        "ssm_dt": (0, 0, 1),
        "ssm_out": (1, 0, c.linear_v_dim),
    }


def reorder_value_heads(c: ModelConfig, base: str, t: torch.Tensor, to_gguf: bool) -> torch.Tensor:
    """The value heads of tensor ``base`` moved between transformers' grouped order and
    llama.cpp's tiled one (``to_gguf``) or back."""
    axes = value_heads_axes(c)
    if base not in axes or c.linear_k_heads == c.linear_v_heads:
        return t
    dim, at, width = axes[base]
    per_key = c.linear_v_heads // c.linear_k_heads
    outer, inner = (c.linear_k_heads, per_key) if to_gguf else (per_key, c.linear_k_heads)
    head, heads = t.narrow(dim, 0, at), t.narrow(dim, at, t.shape[dim] - at)
    return torch.cat((head, swap_heads(heads, dim, outer, inner, width)), dim)


def untiled_blocks(c: ModelConfig, base: str, raw: torch.Tensor, rows: int) -> torch.Tensor | None:
    """The quantized bytes ``raw`` of a GGUF matrix of ``rows`` rows with its value heads
    in transformers' order (what ``fix_tensor`` does to the dequantized weight): rows move
    whole; columns (``ssm_out``) move in whole blocks of 32, or None where a head's width
    is not a multiple of them."""
    axes = value_heads_axes(c)
    if base not in axes or c.linear_k_heads == c.linear_v_heads:
        return raw
    dim, at, _ = axes[base]
    n = rows if dim == 0 else raw.numel() // rows  # (bytes per row, for columns)
    size = rows if dim == 0 else c.linear_v_heads * c.linear_v_dim
    order = torch.arange(size, dtype=torch.float64)
    order = reorder_value_heads(c, base, order if dim == 0 else order[None], False).flatten()
    order = order.long()
    if dim == 0:
        return raw.reshape(rows, -1)[order].reshape(-1)
    if c.linear_v_dim % 32:
        return None
    blocks = raw.reshape(rows, size // 32, n // (size // 32))
    return blocks[:, order[::32] // 32].reshape(-1)


def fix_tensor(c: ModelConfig, canonical: str, t: torch.Tensor, gguf: bool) -> torch.Tensor:
    """A dense tensor as read from the file -> what ``Transformer`` computes with."""
    base = canonical.split(".")[2] if canonical.startswith("blk.") else canonical
    if gguf:
        return reorder_value_heads(c, base, t, to_gguf=False)
    if base in _CENTERED:
        return t + 1
    if base == "ssm_a":  # transformers keeps A_log
        return -torch.exp(t.float()).to(t.dtype)
    return t


FAMILY = Family(
    "qwen3_5_moe",
    ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    ("qwen35moe",),
    from_hf,
    from_gguf,
    gguf_renames={"ffn_norm": "post_attention_norm"},
    fix_tensor=fix_tensor,
)
