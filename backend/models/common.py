"""What the families share: reading configs, mapping names, checking shapes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from backend.errors import ModelLoadError
from backend.formats.gguf import GGUFFile
from backend.formats.tensors import TensorRef
from backend.models import rope
from backend.models.config import ModelConfig
from backend.models.weights import ExpertRef

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Family:
    """One model family: how to read its config and where its tensors are named."""

    name: str
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    config_from_hf: Callable[[dict], ModelConfig]
    config_from_gguf: Callable[[GGUFFile], ModelConfig]
    hf_moe_prefix: str = "mlp"
    hf_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # Canonical tensor base names this family's GGUF files call otherwise.
    gguf_renames: dict[str, str] = field(default_factory=dict)
    # (config, canonical name, tensor as read, read from GGUF?) -> the tensor computed with,
    # for families whose files store a weight otherwise than ``Transformer`` uses it.
    fix_tensor: Callable[[ModelConfig, str, torch.Tensor, bool], torch.Tensor] | None = None
    extra: dict = field(default_factory=dict)
    # transformers' names (under model.layers.N.) of canonical "base[.suffix]" names where
    # they are not the other families'.
    hf_names: dict[str, str] = field(default_factory=dict)
    # The dense tensors' shapes, for a family whose layers are not the shared decoder's.
    shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]] | None = None
    # The ``Transformer`` subclass that computes the family, where the shared one does not.
    transformer: type | None = None


# Tensors llama.cpp names without a ".weight" suffix, and suffixes that replace it.
GGUF_BARE = ("ssm_a",)
GGUF_SUFFIXES = (".bias", ".scale")


def gguf_name(fam: Family, canonical: str) -> str:
    """The GGUF tensor name of canonical ``canonical`` in family ``fam``'s files."""
    if fam.gguf_renames and canonical.startswith("blk."):
        _, layer, rest = canonical.split(".", 2)
        base, dot, suffix = rest.partition(".")
        canonical = f"blk.{layer}.{fam.gguf_renames.get(base, base)}{dot}{suffix}"
    if canonical.endswith(GGUF_SUFFIXES) or canonical.split(".")[-1] in GGUF_BARE:
        return canonical
    return canonical + ".weight"


def hf_config(cfg: dict, family: str, **overrides: object) -> ModelConfig:
    """The fields every HF decoder config has, plus family-specific overrides."""
    theta, scaling = rope.from_hf(cfg)
    heads = cfg["num_attention_heads"]
    fields = dict(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg.get("intermediate_size", 0),
        rms_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        context_length=cfg.get("max_position_embeddings", 4096),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    params = cfg.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial < 1.0:
        fields["rotary_dim"] = int(int(fields["head_dim"]) * partial)
    fields.update(overrides)
    return ModelConfig(**fields)


def hf_windows(
    cfg: dict, flagged: bool = False, slides: Callable[[int], bool] | None = None
) -> dict:
    """``sliding_window`` and ``window_layers`` from a transformers config, as its family
    reads them: with ``flagged``, only where ``use_sliding_window`` is true (Qwen's
    default is false; Mixtral has no flag); on the layers ``layer_types`` calls
    "sliding_attention", else those ``slides`` picks, else every layer."""
    window = cfg.get("sliding_window") or 0
    if not window or (flagged and not cfg.get("use_sliding_window", False)):
        return {}
    types = cfg.get("layer_types")
    if types is None and slides is not None:
        types = ["sliding_attention" if slides(i) else "" for i in range(cfg["num_hidden_layers"])]
    if types is None:
        return {"sliding_window": int(window)}
    return {
        "sliding_window": int(window),
        "window_layers": tuple(t == "sliding_attention" for t in types),
    }


def gguf_windows(g: GGUFFile, n_layers: int) -> dict:
    """The same from llama.cpp's ``attention.sliding_window`` and, where only some layers
    slide, ``attention.sliding_window_pattern`` (one bool per layer, True = sliding; or
    an int n: every n-th layer attends fully, the others slide)."""
    window = int(g.get("attention.sliding_window", 0) or 0)
    if not window:
        return {}
    pattern = g.get("attention.sliding_window_pattern")
    if pattern is None:
        return {"sliding_window": window}
    if isinstance(pattern, int):
        layers = tuple((i + 1) % pattern != 0 for i in range(n_layers)) if pattern else ()
    else:
        layers = tuple(bool(b) for b in pattern)
    return {"sliding_window": window, "window_layers": layers}


def gguf_config(g: GGUFFile, family: str, **overrides: object) -> ModelConfig:
    heads = int(g.get("attention.head_count"))
    hidden = int(g.get("embedding_length"))
    kv_heads = g.get("attention.head_count_kv", heads)  # (one per layer in some files)
    ff = g.get("feed_forward_length", 0) or 0
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    vocab = g.get("vocab_size") or (
        len(tokens) if tokens else g.tensors["token_embd.weight"].shape[0]
    )
    fields = dict(
        family=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        n_layers=int(g.get("block_count")),
        n_heads=heads,
        n_kv_heads=int(max(kv_heads) if isinstance(kv_heads, list) else kv_heads),
        head_dim=int(g.get("attention.key_length", hidden // heads)),
        intermediate_size=int(max(ff) if isinstance(ff, list) else ff),
        rms_eps=float(g.get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(g.get("rope.freq_base", 10000.0)),
        context_length=int(g.get("context_length", 4096)),
        n_experts=int(g.get("expert_count", 0) or 0),
        top_k=int(g.get("expert_used_count", 0) or 0),
        tie_embeddings="output.weight" not in g.tensors,
    )
    head_dim = int(fields["head_dim"])
    # llama.cpp rotates the first rope.dimension_count dims of each head (partial RoPE).
    rotary = int(g.get("rope.dimension_count", head_dim) or head_dim)
    fields["rotary_dim"] = 0 if rotary == head_dim else rotary
    fields.update(rope.from_gguf(g, rotary))
    fields.update(gguf_windows(g, int(fields["n_layers"])))
    fields.update(overrides)
    return ModelConfig(**fields)


def with_sparse_layers(config: ModelConfig, has_router: Callable[[int], bool]) -> ModelConfig:
    """Mark which layers route (some MoE models keep dense MLPs in a few layers)."""
    sparse = tuple(config.n_experts > 0 and has_router(i) for i in range(config.n_layers))
    return replace(config, sparse_layers=sparse)


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical dense tensor name -> row-major shape the config implies."""
    from backend.models import registry  # (registry imports this module)

    own = registry.family(c.family).shapes if c.family in registry.FAMILIES else None
    if own is not None:
        return own(c)
    D = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"token_embd": (c.vocab_size, D), "output_norm": (D,)}
    if not c.tie_embeddings:
        shapes["output"] = (c.vocab_size, D)
    for i in range(c.n_layers):
        p = f"blk.{i}."
        shapes |= {p + "attn_norm": (D,), p + "ffn_norm": (D,)}
        shapes |= _linear_shapes(c, p) if c.linear_layers[i] else _attention_shapes(c, p)
        if c.sparse_layers[i]:
            shapes[p + "ffn_gate_inp"] = (c.n_experts, D)
            if c.router_bias:
                shapes[p + "ffn_gate_inp.bias"] = (c.n_experts,)
            if c.expert_bias:  # small, so resident with the dense weights
                E, I = c.n_experts, c.expert_intermediate_size
                shapes |= {
                    p + "ffn_gate_exps.bias": (E, I),
                    p + "ffn_up_exps.bias": (E, I),
                    p + "ffn_down_exps.bias": (E, D),
                }
            if c.shared_expert_size:
                S = c.shared_expert_size
                shapes |= {
                    p + "ffn_gate_shexp": (S, D),
                    p + "ffn_up_shexp": (S, D),
                    p + "ffn_down_shexp": (D, S),
                }
                shapes[p + "ffn_gate_inp_shexp"] = (1, D)
        else:
            I = c.intermediate_size
            shapes |= {p + "ffn_gate": (I, D), p + "ffn_up": (I, D), p + "ffn_down": (D, I)}
    return shapes


def _attention_shapes(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A softmax attention layer's tensors."""
    D, q, kv = c.hidden_size, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = {
        p + "attn_q": (2 * q if c.attn_gate else q, D),  # with the gate's rows after each head
        p + "attn_k": (kv, D),
        p + "attn_v": (kv, D),
        p + "attn_output": (D, q),
    }
    if c.attn_bias:
        q_bias = (2 * q if c.attn_gate else q,)
        shapes |= {p + "attn_q.bias": q_bias, p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)}
    if c.attn_out_bias:
        shapes[p + "attn_output.bias"] = (D,)
    if c.attn_sinks:
        shapes[p + "attn_sinks"] = (c.n_heads,)
    if c.qk_norm == "head":
        shapes |= {p + "attn_q_norm": (c.head_dim,), p + "attn_k_norm": (c.head_dim,)}
    elif c.qk_norm == "full":
        shapes |= {p + "attn_q_norm": (q,), p + "attn_k_norm": (kv,)}
    return shapes


def _linear_shapes(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors (llama.cpp's names; see ``linear_attention``)."""
    D, Hv, v = c.hidden_size, c.linear_v_heads, c.linear_v_heads * c.linear_v_dim
    return {
        p + "attn_qkv": (c.conv_dim, D),
        p + "attn_gate": (v, D),
        p + "ssm_beta": (Hv, D),
        p + "ssm_alpha": (Hv, D),
        p + "ssm_conv1d": (c.conv_dim, c.conv_kernel),
        p + "ssm_a": (Hv,),
        p + "ssm_dt.bias": (Hv,),
        p + "ssm_norm": (c.linear_v_dim,),
        p + "ssm_out": (D, v),
    }


def check_shape(path: Path, name: str, ref: TensorRef, want: tuple[int, ...]) -> TensorRef:
    if ref.shape == want:
        return ref
    n = 1
    for s in want:
        n *= s
    # A 1-row matrix stored as a vector (GGUF's ffn_gate_inp_shexp) is the same bytes.
    if want[0] == 1 and ref.shape == want[1:]:
        return TensorRef(ref.path, ref.offset, ref.nbytes, ref.qtype, want)
    # So is a tensor with an axis of 1 more (transformers' conv1d weight [C, 1, K]).
    if tuple(s for s in ref.shape if s != 1) == tuple(s for s in want if s != 1):
        return TensorRef(ref.path, ref.offset, ref.nbytes, ref.qtype, want)
    raise ModelLoadError(
        path, f"tensor {name} has shape {list(ref.shape)}, but the config implies {list(want)}"
    )


def check_expert(path: Path, c: ModelConfig, e: ExpertRef) -> None:
    D, I = c.hidden_size, c.expert_intermediate_size
    for part, want in zip(e.parts, ((I, D), (I, D), (D, I)), strict=True):
        if part.shape != want:
            raise ModelLoadError(
                path,
                f"expert {e.expert} of layer {e.layer} has a tensor of shape {list(part.shape)}, but the config implies {list(want)}",
            )


def hf_n_experts(cfg: dict) -> int:
    """Routed experts per layer (transformers 5 writes ``num_local_experts`` for every family)."""
    return int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"])
