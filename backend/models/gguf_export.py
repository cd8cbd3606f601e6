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
from backend.models import registry, rope
from backend.models.common import gguf_name
from backend.models.config import ModelConfig
from backend.models.qwen3_5_moe import reorder_value_heads

_ARCH = {
    "llama": "llama",
    "mixtral": "llama",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
    "qwen2_moe": "qwen2moe",
    "gpt_oss": "gpt-oss",
    "qwen3_5_moe": "qwen35moe",
    "gemma4": "gemma4",
}
# Kept in F32 whatever the target type, as llama.cpp's converter does: tensors whose
# names contain these, and the embedding and output head themselves (not attn_output).
_KEEP_F32 = ("_norm", "ffn_gate_inp", ".bias", "attn_sinks")
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


def _add_linear_attention(w: gguf.GGUFWriter, c: ModelConfig) -> None:
    """llama.cpp's keys for Qwen3.5's Gated DeltaNet layers (one head width for keys and
    values: llama.cpp reads no other), and which layers they are."""
    if c.linear_k_dim != c.linear_v_dim:
        raise ValueError("llama.cpp's qwen35moe has one head width for linear keys and values")
    w.add_ssm_conv_kernel(c.conv_kernel)
    w.add_ssm_state_size(c.linear_k_dim)
    w.add_ssm_group_count(c.linear_k_heads)
    w.add_ssm_time_step_rank(c.linear_v_heads)
    w.add_ssm_inner_size(c.linear_v_heads * c.linear_v_dim)
    every = next((i + 1 for i, lin in enumerate(c.linear_layers) if not lin), 0)
    if every and c.linear_layers == tuple((i + 1) % every != 0 for i in range(c.n_layers)):
        w.add_full_attention_interval(every)
    else:
        key = f"{w.arch}.attention.recurrent_layers"
        w.add_array(key, [bool(b) for b in c.linear_layers])
    # Required by llama.cpp's loader: interleaved M-RoPE turns pair i by the t, h or w
    # position as i % 3 is 0, 1 or 2, within each one's count, and by a fourth position
    # (0 for text) past them. Text gives t, h and w the same position, so counts covering
    # every pair compute plain RoPE: (11, 11, 10) for 32 pairs, its converter's default.
    pairs = c.rope_dim // 2
    w.add_rope_dimension_sections([(pairs + 2) // 3, (pairs + 1) // 3, pairs // 3, 0])


def _add_gemma4(w: gguf.GGUFWriter, c: ModelConfig) -> None:
    """llama.cpp's keys for Gemma 4's two kinds of layer (the full layers' in the common
    keys), its soft cap, and the features it has but we do not take, off."""
    swa = c.swa_head_dim or c.head_dim
    w.add_key_length_swa(swa)
    w.add_value_length_swa(swa)
    w.add_rope_dimension_count(c.head_dim)  # proportional RoPE: all pairs, some still
    w.add_rope_dimension_count_swa(swa)
    w.add_rope_freq_base_swa(c.swa_rope_theta or c.rope_theta)
    if c.logit_softcap:
        w.add_final_logit_softcapping(c.logit_softcap)
    w.add_shared_kv_layers(0)
    w.add_embedding_length_per_layer_input(0)


def write_gguf(
    model, out: str | Path, qtype: QType = QType.F32, vocab_from: str | Path | None = None
) -> Path:
    """``model`` is a ``LoadedModel``; experts are written fused (``ffn_*_exps``). With
    ``vocab_from`` (a GGUF), its ``tokenizer.*`` keys are copied in."""
    resident = model.resident_experts(budget_mib=0)

    def experts(layer: int) -> list:
        return [resident.get(layer, e) for e in range(len(model.experts[layer]))]

    dense = {k: v for k, v in model.transformer.w.items()}
    return _write(model.config, dense, experts, out, qtype, vocab_from)


def _copy_vocab(w: gguf.GGUFWriter, source: str | Path) -> None:
    for key, f in gguf.GGUFReader(source).fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub)


def convert_gpt_oss(folder: str | Path, out: str | Path, qtype: QType = QType.F32) -> Path:
    """A gpt-oss Hugging Face folder with float weights as a GGUF llama.cpp would write:
    each layer's fused gate/up (columns interleaved, [E, D, 2I]) split into ``ffn_gate_exps``
    and ``ffn_up_exps`` [E, I, D], down transposed, their biases apart, names as llama.cpp's."""
    from backend.formats.safetensors import read_hf_folder
    from backend.formats.tensors import MappedFiles
    from backend.models.gpt_oss import config_of_hf

    h = read_hf_folder(folder)
    c = config_of_hf(h.config)
    files = MappedFiles()
    t = {name: files.load(ref) for name, ref in h.tensors.items()}
    attn = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}
    dense = {
        "token_embd": t["model.embed_tokens.weight"],
        "output_norm": t["model.norm.weight"],
    }
    if not c.tie_embeddings:
        dense["output"] = t["lm_head.weight"]
    stacks: dict[int, list] = {}
    for i in range(c.n_layers):
        p, q = f"model.layers.{i}.", f"blk.{i}."
        dense[q + "attn_norm"] = t[p + "input_layernorm.weight"]
        dense[q + "ffn_norm"] = t[p + "post_attention_layernorm.weight"]
        for ours, theirs in attn.items():
            dense[q + ours] = t[p + f"self_attn.{theirs}.weight"]
            dense[q + ours + ".bias"] = t[p + f"self_attn.{theirs}.bias"]
        dense[q + "attn_sinks"] = t[p + "self_attn.sinks"]
        dense[q + "ffn_gate_inp"] = t[p + "mlp.router.weight"]
        dense[q + "ffn_gate_inp.bias"] = t[p + "mlp.router.bias"]
        gate_up, gate_up_bias = (
            t[p + "mlp.experts.gate_up_proj"],
            t[p + "mlp.experts.gate_up_proj_bias"],
        )
        dense[q + "ffn_gate_exps.bias"] = gate_up_bias[:, 0::2]
        dense[q + "ffn_up_exps.bias"] = gate_up_bias[:, 1::2]
        dense[q + "ffn_down_exps.bias"] = t[p + "mlp.experts.down_proj_bias"]
        gate = gate_up[:, :, 0::2].transpose(1, 2)  # [E, I, D]
        up = gate_up[:, :, 1::2].transpose(1, 2)
        down = t[p + "mlp.experts.down_proj"].transpose(1, 2)  # [E, D, I]
        stacks[i] = [(gate[e], up[e], down[e]) for e in range(c.n_experts)]
    try:
        return _write(c, dense, stacks.__getitem__, out, qtype)
    finally:
        files.close()


def _write(
    config: ModelConfig,
    dense: dict,
    experts,
    out: str | Path,
    qtype: QType,
    vocab_from: str | Path | None = None,
) -> Path:
    """Write ``dense`` (canonical name -> tensor) and each sparse layer's ``experts(layer)``
    ([(gate, up, down)] per expert) as ``out``."""
    c = config
    arch = _ARCH[c.family]
    out = Path(out)
    w = gguf.GGUFWriter(out, arch)
    w.add_block_count(c.n_layers)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.hidden_size)
    ff = (
        c.expert_intermediate_size
        if c.family in ("mixtral", "olmoe", "gpt_oss", "qwen3_5_moe")
        else c.intermediate_size
    )
    w.add_feed_forward_length(ff)
    w.add_head_count(c.n_heads)
    if c.swa_kv_heads:
        w.add_head_count_kv([c.attn_dims(i)[0] for i in range(c.n_layers)])
    else:
        w.add_head_count_kv(c.n_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_freq_base(c.rope_theta)
    _add_rope_scaling(w, c)
    if c.sliding_window:
        w.add_sliding_window(c.sliding_window)
        alternating = tuple(i % 2 == 0 for i in range(c.n_layers))
        if arch == "gemma4" or (
            not all(c.window_layers) and not (arch == "gpt-oss" and c.window_layers == alternating)
        ):
            w.add_sliding_window_pattern(list(c.window_layers))
    if c.rope_dim != c.head_dim:
        w.add_rope_dimension_count(c.rope_dim)
    if arch == "gemma4":
        _add_gemma4(w, c)
    if c.conv_kernel:  # (llama.cpp reads these keys even where no layer is linear)
        _add_linear_attention(w, c)
    w.add_vocab_size(c.vocab_size)
    if c.n_experts:
        w.add_expert_count(c.n_experts)
        w.add_expert_used_count(c.top_k)
        w.add_expert_feed_forward_length(c.expert_intermediate_size)
        w.add_expert_weights_norm(c.norm_topk_prob)
    if c.shared_expert_size:
        w.add_expert_shared_feed_forward_length(c.shared_expert_size)
    if vocab_from is not None:
        _copy_vocab(w, vocab_from)
    fam = registry.family(c.family)
    for canonical, tensor in dense.items():
        if canonical == "output" and c.tie_embeddings:
            continue
        arr = tensor.float().cpu().numpy()
        if arch == "llama" and canonical.split(".")[-1] in ("attn_q", "attn_k"):
            arr = _permute(arr, c.n_heads if canonical.endswith("attn_q") else c.n_kv_heads)
        if c.family == "qwen3_5_moe" and canonical.startswith("blk."):
            base = canonical.split(".")[2]
            arr = reorder_value_heads(c, base, torch.from_numpy(arr), to_gguf=True).numpy()
        name = gguf_name(fam, canonical)
        data, dtype = _encode(arr, name, qtype)
        w.add_tensor(name, data, raw_dtype=dtype)
    for layer, sparse in enumerate(c.sparse_layers):
        if not sparse:
            continue
        weights = experts(layer)
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
