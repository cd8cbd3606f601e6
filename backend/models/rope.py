"""Rotary position embeddings: the frequencies each family's config implies.

Plain RoPE rotates pair ``i`` of a head by ``pos * theta^(-2i/Dh)``. Long-context models
rescale those frequencies: ``linear`` divides all of them by a factor (position
interpolation), ``llama3`` divides only the low frequencies, blending in between (Llama
3.1 and later), and ``yarn`` blends interpolated and original frequencies by a ramp over
the pairs and scales cos and sin by an attention factor (Qwen, gpt-oss, DeepSeek). The
formulas are those of transformers' ``modeling_rope_utils``, computed in the same float32
steps; llama.cpp computes the same ones from its GGUF keys (``rope.scaling.*``) and, for
``llama3``, from per-pair divisors stored as the ``rope_freqs`` tensor.
"""

from __future__ import annotations

import math

import torch

from backend.errors import ModelLoadError
from backend.formats.gguf import GGUFFile
from backend.formats.tensors import TensorRef
from backend.kernels.quants import QType, dequantize
from backend.models.config import ModelConfig, RopeScaling

KINDS = ("linear", "llama3", "yarn")


def base_inv_freq(theta: float, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """theta^(-2i/Dh) for the Dh/2 pairs of a head, float32."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64).float().to(device)
    return 1.0 / (theta ** (steps / head_dim))


def yarn_mscale(factor: float) -> float:
    """YaRN's default attention factor for a context ``factor`` times the original."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_context / s.low_freq_factor
    high_wavelen = s.original_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_context / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, head_dim: int, s: RopeScaling, device) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(s.original_context / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (
        torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float) / head_dim
    )
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp).to(device)  # 1 where the original frequency is kept (high frequencies)
    return interpolation * (1 - keep) + extrapolation * keep


def inv_freq(c: ModelConfig, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """(the Dh/2 rotation frequencies float32, the factor cos and sin are scaled by)."""
    s = c.rope_scaling
    if s is not None and s.kind == "yarn":
        inv = _yarn(c.rope_theta, c.rope_dim, s, device)
        factor = yarn_mscale(s.factor) if s.attention_factor is None else s.attention_factor
        return inv, float(factor)
    inv = base_inv_freq(c.rope_theta, c.rope_dim, device)
    if s is not None and s.kind == "linear":
        inv = inv / s.factor
    elif s is not None and s.kind == "llama3":
        inv = _llama3(inv, s)
    if c.rope_freq_factors:
        inv = inv / torch.tensor(c.rope_freq_factors, dtype=torch.float32, device=device)
    return inv, 1.0


def llama3_freq_factors(c: ModelConfig) -> tuple[float, ...]:
    """The per-pair divisors llama.cpp stores as ``rope_freqs`` for a ``llama3`` config."""
    base = base_inv_freq(c.rope_theta, c.rope_dim)
    return tuple((base / _llama3(base, c.rope_scaling)).tolist())


def from_hf(cfg: dict) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from a transformers config (``rope_parameters`` or ``rope_scaling``)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return theta, None
    if kind not in KINDS:
        raise ValueError(
            f"unsupported rope scaling {kind!r} (supported: default, {', '.join(KINDS)})"
        )
    original = rope.get("original_max_position_embeddings")
    factor = rope.get("factor")
    if factor is None and kind == "yarn" and original:
        factor = cfg["max_position_embeddings"] / original
    if kind == "yarn" and rope.get("mscale") and rope.get("mscale_all_dim"):
        raise ValueError("unsupported rope scaling 'yarn' with mscale_all_dim (DeepSeek style)")
    if factor is None or (kind != "linear" and not original):
        raise ValueError(f"rope scaling {kind!r} needs factor and original_max_position_embeddings")
    return theta, RopeScaling(
        kind,
        float(factor),
        int(original or 0),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        attention_factor=rope.get("attention_factor"),
        truncate=bool(rope.get("truncate", True)),
    )


def _small_tensor(ref: TensorRef) -> torch.Tensor:
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        raw = torch.frombuffer(bytearray(f.read(ref.nbytes)), dtype=torch.uint8)
    return dequantize(raw, ref.qtype, ref.shape)


def from_gguf(g: GGUFFile, head_dim: int) -> dict:
    """ModelConfig fields for RoPE from llama.cpp's keys and ``rope_freqs`` tensor, which
    it reads as llama.cpp does (a factor without a type is linear). Raises
    ModelLoadError for what it cannot compute."""
    try:
        return _gguf_fields(g, head_dim)
    except ValueError as exc:
        raise ModelLoadError(g.path, str(exc)) from None


def _gguf_fields(g: GGUFFile, head_dim: int) -> dict:
    fields: dict = {}
    factor = float(g.get("rope.scaling.factor", 0.0) or 0.0)
    if not factor and g.get("rope.scale_linear"):  # the key before rope.scaling.*
        factor = float(g.get("rope.scale_linear"))
    kind = str(g.get("rope.scaling.type", "linear" if factor else "none") or "none")
    if kind in ("linear", "yarn") and factor and factor != 1.0:
        attn = g.get("rope.scaling.attn_factor")
        fields["rope_scaling"] = RopeScaling(
            kind,
            factor,
            int(g.get("rope.scaling.original_context_length", 0) or 0),
            beta_fast=float(g.get("rope.scaling.yarn_beta_fast", 32.0) or 32.0),
            beta_slow=float(g.get("rope.scaling.yarn_beta_slow", 1.0) or 1.0),
            # llama.cpp multiplies YaRN's own factor by attn_factor.
            attention_factor=None if attn is None else float(attn) * yarn_mscale(factor),
        )
        if kind == "yarn" and not fields["rope_scaling"].original_context:
            raise ValueError("rope scaling 'yarn' needs rope.scaling.original_context_length")
    elif kind not in ("none", "linear", "yarn"):
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: none, linear, yarn)")
    ref = g.tensors.get("rope_freqs.weight")
    if ref is not None:
        if ref.shape != (head_dim // 2,) or ref.qtype != QType.F32:
            raise ValueError(
                f"rope_freqs has shape {list(ref.shape)} ({ref.qtype.name}), "
                f"expected [{head_dim // 2}] F32"
            )
        if kind == "yarn":
            raise ValueError("unsupported rope scaling: yarn with a rope_freqs tensor")
        fields["rope_freq_factors"] = tuple(_small_tensor(ref).tolist())
    return fields
