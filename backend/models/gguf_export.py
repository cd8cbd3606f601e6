"""Write a loaded model as a llama.cpp-compatible GGUF (F32, F16 or a quantized type).

Used to convert HF folders and, in tests, to check that the GGUF path computes what the
HF path computes. llama-arch files get llama.cpp's q/k permutation (adjacent-pair RoPE).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from backend.kernels.quants import QType
from backend.models import rope
from backend.models.config import ModelConfig

_ARCH = {
    "llama": "llama",
    "mixtral": "llama",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
    "qwen2_moe": "qwen2moe",
}
# Kept in F32 whatever the target type, as llama.cpp's converter does: tensors whose
# names contain these, and the embedding and output head themselves (not attn_output).
_KEEP_F32 = ("_norm", "ffn_gate_inp", ".bias")
_KEEP_F32_NAMES = ("token_embd", "output")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved layout."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _encode(w: np.ndarray, name: str, qtype: QType) -> tuple[np.ndarray, QType]:
    keep = any(k in name for k in _KEEP_F32) or name.removesuffix(".weight") in _KEEP_F32_NAMES
    if keep or w.ndim < 2 or w.shape[-1] % 32:
        return w.astype(np.float32), QType.F32
    if qtype == QType.F32:
        return w.astype(np.float32), qtype
    if qtype == QType.F16:
        return w.astype(np.float16), qtype
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def _add_rope_scaling(w: gguf.GGUFWriter, c: ModelConfig) -> None:
    """llama.cpp's keys for linear and YaRN scaling; llama3's as the ``rope_freqs``
    divisors, as llama.cpp's converter writes them."""
    s, factors = c.rope_scaling, c.rope_freq_factors
    if s is not None and s.kind == "llama3":
        factors = rope.llama3_freq_factors(c)
    elif s is not None:
        kind = gguf.RopeScalingType.LINEAR if s.kind == "linear" else gguf.RopeScalingType.YARN
        w.add_rope_scaling_type(kind)
        w.add_rope_scaling_factor(s.factor)
        if s.original_context:
            w.add_rope_scaling_orig_ctx_len(s.original_context)
        if s.kind == "yarn":
            if not s.truncate:
                raise ValueError("llama.cpp always rounds YaRN's ramp: truncate=False has no key")
            w.add_rope_scaling_yarn_beta_fast(s.beta_fast)
            w.add_rope_scaling_yarn_beta_slow(s.beta_slow)
            if s.attention_factor is not None:
                w.add_rope_scaling_attn_factors(s.attention_factor / rope.yarn_mscale(s.factor))
    if factors:
        w.add_tensor("rope_freqs.weight", np.asarray(factors, dtype=np.float32))


def write_gguf(model, out: str | Path, qtype: QType = QType.F32) -> Path:
    """``model`` is a ``LoadedModel``; experts are written fused (``ffn_*_exps``)."""
    c: ModelConfig = model.config
    arch = _ARCH[c.family]
    out = Path(out)
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(c.n_layers)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.hidden_size)
    ff = c.expert_intermediate_size if c.family in ("mixtral", "olmoe") else c.intermediate_size
    w.add_feed_forward_length(ff)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_freq_base(c.rope_theta)
    _add_rope_scaling(w, c)
    if c.sliding_window:
        w.add_sliding_window(c.sliding_window)
        if not all(c.window_layers):
            w.add_sliding_window_pattern(list(c.window_layers))
    w.add_vocab_size(c.vocab_size)
    if c.n_experts:
        w.add_expert_count(c.n_experts)
        w.add_expert_used_count(c.top_k)
        w.add_expert_feed_forward_length(c.expert_intermediate_size)
        w.add_expert_weights_norm(c.norm_topk_prob)
    if c.shared_expert_size:
        w.add_expert_shared_feed_forward_length(c.shared_expert_size)
    t = model.transformer
    for canonical, tensor in t.w.items():
        if canonical == "output" and c.tie_embeddings:
            continue
        arr = tensor.float().cpu().numpy()
        if arch == "llama" and canonical.split(".")[-1] in ("attn_q", "attn_k"):
            arr = _permute(arr, c.n_heads if canonical.endswith("attn_q") else c.n_kv_heads)
        name = canonical if canonical.endswith(".bias") else canonical + ".weight"
        data, dtype = _encode(arr, name, qtype)
        w.add_tensor(name, data, raw_dtype=dtype)
    resident = model.resident_experts(budget_mib=0)
    for layer, row in enumerate(model.experts):
        if not row:
            continue
        weights = [resident.get(layer, e) for e in range(len(row))]
        for i, part in enumerate(("gate", "up", "down")):
            stacked = torch.stack([x[i] for x in weights]).float().numpy()
            name = f"blk.{layer}.ffn_{part}_exps.weight"
            data, dtype = _encode(stacked, name, qtype)
            w.add_tensor(name, data, raw_dtype=dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
