"""Gemma 4 (text): sliding and full attention layers with their own head width, KV heads
and RoPE, and an MLP beside the routed experts in every layer.

What sets it apart from the other families, as transformers' ``modeling_gemma4`` and
llama.cpp's ``gemma4`` compute it:

- Attention: q/k RMSNorm per head and a weightless RMSNorm on the values; scores are not
  scaled (1, not 1/sqrt(Dh)); the output is normalized before the residual add. Sliding
  layers (``window_layers``) use ``swa_head_dim``, ``swa_kv_heads`` and RoPE base
  ``swa_rope_theta``; full layers use ``head_dim``, ``n_kv_heads`` and "proportional"
  RoPE: only the first pairs of each head turn, at frequencies theta^(-2i/Dh) of the whole
  width. llama.cpp stores that as per-pair divisors (``rope_freqs``: 1 for the pairs
  that turn, 1e30 for the rest), and so do we. With ``k_eq_v`` the full layers have no
  value projection: their values are the keys' projection, normalized without weight.
- FFN: a dense GELU MLP on ``ffn_norm(h)`` beside the routed experts on
  ``pre_ffw_norm_2(h)``, each normalized after (``post_ffw_norm_1``, ``_2``), summed,
  normalized again (``post_ffw_norm``) and added to h; the layer's output is scaled by
  ``layer_output_scale``. Experts are GELU-gated (the eager expert backend).
- Router: on h RMS-normalized without weight, times a learned ``ffn_gate_inp.scale`` and
  1/sqrt(D); softmax over every expert, top-k renormalized, each weight then scaled by its
  expert's ``ffn_down_exps.scale``.
- The embedding is scaled by sqrt(D) and the logits soft-capped.
- Its norms multiply by their weight as stored (no 1 + w, unlike Gemma 1-3).

Not taken, each refused with its reason: per-layer embeddings (E2B, E4B), layers that
reuse another layer's keys and values, bidirectional attention, RoPE other than these.
The published checkpoints are multimodal (Gemma4ForConditionalGeneration): the text
model is read and the vision and audio towers beside it are left alone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from backend.formats.gguf import GGUFFile
from backend.kernels.dense import rowwise
from backend.models import rope
from backend.models.common import Family, gguf_config, hf_config, hf_n_experts, hf_windows
from backend.models.config import ModelConfig
from backend.models.transformer import (
    SeqSlice,
    Transformer,
    angle_table,
    gelu_tanh,
    rms_norm,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

# llama.cpp's divisor for a pair proportional RoPE leaves still (its converter's value).
STILL = 1e30

_REFUSED_HF = (
    ("hidden_size_per_layer_input", "per-layer embeddings (Gemma 4 E2B and E4B)"),
    ("num_kv_shared_layers", "layers that reuse another layer's keys and values"),
)


def _proportional_factors(head_dim: int, partial: float) -> tuple[float, ...]:
    """``rope_freqs`` of proportional RoPE turning ``partial`` of a head's pairs."""
    turning = int(partial * head_dim // 2)
    if turning >= head_dim // 2:
        return ()
    return (1.0,) * turning + (STILL,) * (head_dim // 2 - turning)


def from_hf(cfg: dict) -> ModelConfig:
    if "text_config" in cfg:  # the published multimodal checkpoint: its text model's config
        cfg = {**cfg, **cfg["text_config"]}
    for key, what in _REFUSED_HF:
        if cfg.get(key):
            raise ValueError(f"Gemma 4 with {what} is not supported ({key} = {cfg[key]})")
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("Gemma 4 with bidirectional attention is not supported")
    n_layers = cfg["num_hidden_layers"]
    types = list(cfg.get("layer_types") or [])
    if not types:  # transformers' default: every sixth layer full
        types = [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)
        ]
    types[-1] = "full_attention"  # (transformers forces the last layer full)
    # The full layers' overrides, as transformers resolves them: a saved per_layer_config,
    # else global_head_dim (512) and, with K=V, num_global_key_value_heads.
    per = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    full = per.get(next(i for i, t in enumerate(types) if t == "full_attention"), {})
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    head_dim = full.get("head_dim") or cfg.get("global_head_dim") or 512
    kv_heads = (
        full.get("num_key_value_heads")
        or (cfg.get("num_global_key_value_heads") if k_eq_v else None)
        or cfg["num_key_value_heads"]
    )
    if cfg.get("attention_bias"):
        raise ValueError("Gemma 4 with attention biases is not supported")
    params = cfg.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1_000_000.0,
        },
    }
    slide, whole = params.get("sliding_attention") or {}, params.get("full_attention") or {}
    if slide.get("rope_type", "default") != "default" or slide.get("partial_rotary_factor", 1) != 1:
        raise ValueError(f"unsupported RoPE for Gemma 4's sliding layers: {slide}")
    kind = whole.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise ValueError(f"unsupported RoPE for Gemma 4's full layers: {whole}")
    if float(whole.get("factor", 1.0)) != 1.0:
        raise ValueError(f"unsupported scaled RoPE for Gemma 4's full layers: {whole}")
    partial = float(whole.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported activation {cfg['hidden_activation']!r} for Gemma 4")
    moe = bool(cfg.get("enable_moe_block", False))
    plain = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling")}
    plain["head_dim"] = head_dim
    return hf_config(
        plain,
        "gemma4",
        n_kv_heads=kv_heads,
        rope_theta=float(whole.get("rope_theta", 1_000_000.0)),
        rope_freq_factors=_proportional_factors(head_dim, partial),
        n_experts=hf_n_experts(cfg) if moe else 0,
        top_k=int(cfg.get("top_k_experts") or 0) if moe else 0,
        expert_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if moe else 0,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        swa_head_dim=int(cfg["head_dim"]),
        swa_kv_heads=int(cfg["num_key_value_heads"]),
        swa_rope_theta=float(slide.get("rope_theta", 10_000.0)),
        k_eq_v=k_eq_v,
        logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        **_GEMMA4,
        **_embed(cfg["hidden_size"]),
        **hf_windows({**cfg, "layer_types": types}),
    )


# What every Gemma 4 has.
_GEMMA4 = dict(qk_norm="head", norm_topk_prob=True, expert_act="gelu", attn_scale=1.0)


def _embed(hidden: int) -> dict:
    # sqrt(D) in float32, as llama.cpp computes it (transformers rounds it to the weights'
    # dtype: ``Gemma4Transformer.embed`` does too)
    return {"embed_scale": float(torch.tensor(hidden**0.5, dtype=torch.float32))}


def _per_layer(value: object, n_layers: int, keep: list[bool]) -> list[int]:
    """A GGUF key that is one int or one per layer -> the values of the layers ``keep``."""
    values = value if isinstance(value, list) else [value] * n_layers
    return sorted({int(v) for v, k in zip(values, keep, strict=True) if k})


def from_gguf(g: GGUFFile) -> ModelConfig:
    n_layers = int(g.get("block_count"))
    if int(g.get("embedding_length_per_layer_input", 0) or 0):
        raise ValueError("Gemma 4 with per-layer embeddings (E2B, E4B) is not supported")
    if int(g.get("attention.shared_kv_layers", 0) or 0):
        raise ValueError(
            "Gemma 4 with layers that reuse another layer's keys and values is not supported"
        )
    slides = [bool(b) for b in g.get("attention.sliding_window_pattern")]
    kv = g.get("attention.head_count_kv")
    full_kv = _per_layer(kv, n_layers, [not s for s in slides])
    swa_kv = _per_layer(kv, n_layers, slides)
    if len(full_kv) > 1 or len(swa_kv) > 1:
        raise ValueError(f"KV heads vary within a kind of layer: {kv}")
    head_dim = int(g.get("attention.key_length"))
    swa_dim = int(g.get("attention.key_length_swa", head_dim))
    if int(g.get("rope.dimension_count_swa", swa_dim) or swa_dim) != swa_dim:
        raise ValueError("partial RoPE in Gemma 4's sliding layers is not supported")
    first_full = slides.index(False)
    # llama.cpp requires the proportional RoPE divisors of the full layers; a header read
    # for its config alone (no tensors) has none to check.
    if g.tensors and "rope_freqs.weight" not in g.tensors:
        raise ValueError("no rope_freqs tensor (the full layers' proportional RoPE)")
    ff = g.get("feed_forward_length")
    return gguf_config(
        g,
        "gemma4",
        n_kv_heads=full_kv[0] if full_kv else swa_kv[0],
        intermediate_size=int(ff[0] if isinstance(ff, list) else ff),
        expert_intermediate_size=int(g.get("expert_feed_forward_length", 0) or 0),
        swa_head_dim=swa_dim,
        swa_kv_heads=swa_kv[0] if swa_kv else 0,
        swa_rope_theta=float(g.get("rope.freq_base_swa", 10_000.0)),
        k_eq_v=f"blk.{first_full}.attn_v.weight" not in g.tensors,
        logit_softcap=float(g.get("final_logit_softcapping", 0.0) or 0.0),
        **_GEMMA4,
        **_embed(int(g.get("embedding_length"))),
    )


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical dense tensor name -> shape, for every Gemma 4 layer."""
    D, H, I = c.hidden_size, c.n_heads, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"token_embd": (c.vocab_size, D), "output_norm": (D,)}
    if not c.tie_embeddings:
        shapes["output"] = (c.vocab_size, D)
    for i in range(c.n_layers):
        p = f"blk.{i}."
        G, Dh = c.attn_dims(i)
        for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            shapes[p + n] = (D,)
        shapes |= {p + "attn_q": (H * Dh, D), p + "attn_k": (G * Dh, D)}
        if not (c.k_eq_v and not c.window_layers[i]):
            shapes[p + "attn_v"] = (G * Dh, D)
        shapes |= {
            p + "attn_output": (D, H * Dh),
            p + "attn_q_norm": (Dh,),
            p + "attn_k_norm": (Dh,),
        }
        shapes |= {p + "ffn_gate": (I, D), p + "ffn_up": (I, D), p + "ffn_down": (D, I)}
        shapes[p + "layer_output_scale"] = (1,)
        if c.sparse_layers[i]:
            for n in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2", "ffn_gate_inp.scale"):
                shapes[p + n] = (D,)
            shapes |= {
                p + "ffn_gate_inp": (c.n_experts, D),
                p + "ffn_down_exps.scale": (c.n_experts,),
            }
    return shapes


class Gemma4Transformer(Transformer):
    """``Transformer`` with Gemma 4's attention, router and FFN (see the module's doc)."""

    def __init__(self, config: ModelConfig, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        c = self.config
        swa = replace(c, head_dim=c.swa_head_dim or c.head_dim, rotary_dim=0, rope_freq_factors=())
        swa = replace(swa, rope_theta=c.swa_rope_theta or c.rope_theta)
        self._swa_inv_freq, _ = rope.inv_freq(swa, self.device)
        self._swa_tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(ids)
        return x * torch.tensor(self.config.embed_scale, dtype=x.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = super().logits(h)
        cap = self.config.logit_softcap
        return out if not cap else torch.tanh(out / cap) * cap

    def _block_weights(self, layer: int, ffn: bool, router: bool) -> None:
        return None  # the native attention block computes none of this

    def attention_block(
        self, layer: int, h: torch.Tensor, seqs: Sequence[SeqSlice]
    ) -> torch.Tensor:
        c, w, p = self.config, self.w, f"blk.{layer}."
        T, eps = h.shape[0], c.rms_eps
        G, Dh = c.attn_dims(layer)
        prompt = any(s.n != 1 for s in seqs)
        x = rms_norm(h, w[p + "attn_norm"], eps)
        q = self.linear(p + "attn_q", x, prompt=prompt).view(T, c.n_heads, Dh)
        k = self.linear(p + "attn_k", x, prompt=prompt).view(T, G, Dh)
        v = (
            k
            if p + "attn_v" not in w
            else self.linear(p + "attn_v", x, prompt=prompt).view(T, G, Dh)
        )
        q = rms_norm(q, w[p + "attn_q_norm"], eps)
        k = rms_norm(k, w[p + "attn_k_norm"], eps)
        v = rms_norm(v, 1.0, eps)
        if c.window_layers[layer]:
            table = angle_table(self._swa_tables, self._swa_inv_freq, 1.0, self._end(seqs), q.dtype)
        else:
            table = self.rope_table(self._end(seqs), q.dtype)
        cos, sin = (torch.cat([t[s.start : s.start + s.n] for s in seqs]) for t in table)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        out = self._attend(layer, q, k, v, seqs, c.attn_scale or Dh**-0.5)
        out = self.linear(p + "attn_output", out.reshape(T, -1), prompt=prompt)
        return h + rms_norm(out, w[p + "post_attention_norm"], eps)

    @staticmethod
    def _end(seqs: Sequence[SeqSlice]) -> int:
        return max(s.start + s.n for s in seqs)

    def ffn_input(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The routed experts' input (``pre_ffw_norm_2``); a dense layer's MLP input."""
        name = "pre_ffw_norm_2" if self.config.sparse_layers[layer] else "ffn_norm"
        return rms_norm(h, self.w[f"blk.{layer}.{name}"], self.config.rms_eps)

    def router_input(self, layer: int, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        scale = self.w[f"blk.{layer}.ffn_gate_inp.scale"]
        return rms_norm(h, scale, self.config.rms_eps) * self.config.hidden_size**-0.5

    def route(
        self, layer: int, x: torch.Tensor, prompt: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ids, weights = super().route(layer, x, prompt)
        return ids, weights * self.w[f"blk.{layer}.ffn_down_exps.scale"][ids]

    def dense_mlp(self, layer: int, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        p = f"blk.{layer}."
        gate = self.linear(p + "ffn_gate", x, prompt=prompt)
        up = self.linear(p + "ffn_up", x, prompt=prompt)
        return self.linear(p + "ffn_down", rowwise(gelu_tanh, gate) * up, prompt=prompt)

    def ffn_output(
        self, layer: int, h: torch.Tensor, x: torch.Tensor, y: torch.Tensor | None, prompt: bool
    ) -> torch.Tensor:
        c, w, p = self.config, self.w, f"blk.{layer}."
        if not c.sparse_layers[layer]:
            out = self.dense_mlp(layer, x, prompt)
        else:
            mlp = self.dense_mlp(layer, rms_norm(h, w[p + "ffn_norm"], c.rms_eps), prompt)
            out = rms_norm(mlp, w[p + "post_ffw_norm_1"], c.rms_eps) + rms_norm(
                y, w[p + "post_ffw_norm_2"], c.rms_eps
            )
        return (h + rms_norm(out, w[p + "post_ffw_norm"], c.rms_eps)) * w[p + "layer_output_scale"]


# transformers' names under model.layers.N. where they are not the other families'.
HF_NAMES = {
    "post_attention_norm": "post_attention_layernorm.weight",
    "ffn_norm": "pre_feedforward_layernorm.weight",
    "post_ffw_norm": "post_feedforward_layernorm.weight",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2": "post_feedforward_layernorm_2.weight",
    "ffn_gate_inp": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "layer_output_scale": "layer_scalar",
}

FAMILY = Family(
    "gemma4",
    ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    ("gemma4",),
    from_hf,
    from_gguf,
    hf_moe_prefix="",
    hf_names=HF_NAMES,
    shapes=expected_shapes,
    transformer=Gemma4Transformer,
)
