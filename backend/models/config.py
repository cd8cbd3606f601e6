"""Model hyper-parameters shared by every family (frozen, validated)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeScaling:
    """A long-context rescaling of RoPE's frequencies (see ``backend.models.rope``)."""

    kind: str  # "linear", "llama3" or "yarn"
    factor: float
    original_context: int = 0  # the context length the model was pretrained at
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn: the ramp's ends, in rotations over the original context
    beta_slow: float = 1.0
    attention_factor: float | None = None  # yarn: cos/sin scale; None: 0.1 ln(factor) + 1
    truncate: bool = True  # yarn: round the ramp's ends to whole pairs


@dataclass(frozen=True)
class ModelConfig:
    family: str  # registry key: llama, mixtral, qwen3_moe, olmoe, qwen2_moe
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (layers without routed experts)
    rms_eps: float
    rope_theta: float
    rope_interleaved: bool = False  # GGUF llama q/k are permuted: rotate adjacent pairs
    context_length: int = 4096
    n_experts: int = 0
    top_k: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k softmax weights to sum to 1
    qk_norm: str | None = None  # "head": RMSNorm per head (qwen3); "full": over all heads (olmoe)
    attn_bias: bool = False
    shared_expert_size: int = 0  # qwen2_moe: always-on expert with a sigmoid gate
    clip_qkv: float | None = None
    sparse_layers: tuple[bool, ...] = field(default=())  # True where the MLP is routed experts
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] = ()  # GGUF rope_freqs: per-pair frequency divisors
    sliding_window: int = 0  # keys a sliding layer's query sees: its own and the W-1 before
    window_layers: tuple[bool, ...] = field(default=())  # True where a layer slides
    # gpt-oss: a learned logit per head that takes a share of each softmax (``attn_sinks``),
    # a bias on the attention output, a biased router whose top-k logits are softmaxed
    # ("topk"; else "all": softmax over every expert, then top-k), and experts with biases
    # and the clamped SwiGLU (``expert_act`` "swiglu_oai": alpha, limit).
    attn_sinks: bool = False
    attn_out_bias: bool = False
    router_bias: bool = False
    router_softmax: str = "all"
    expert_act: str = "silu"
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Partial RoPE: the first ``rotary_dim`` dims of each head rotate (0: all of them).
    rotary_dim: int = 0
    # Qwen3.5: q_proj also writes a gate per head; attention's output is scaled by its
    # sigmoid before the output projection.
    attn_gate: bool = False
    # Qwen3.5's hybrid stack: True where a layer is a Gated DeltaNet (linear attention with
    # a causal conv and a recurrent state per sequence) instead of softmax attention.
    linear_layers: tuple[bool, ...] = field(default=())
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 0
    # Gemma 4: sliding layers with their own head width, KV heads and RoPE base (0: the
    # others'), full layers whose values come from the keys' projection (``k_eq_v``), an
    # attention score scale (0: 1/sqrt(Dh)), a scaled embedding and soft-capped logits
    # (``logit_softcap`` c: c * tanh(logits / c); 0: none).
    swa_head_dim: int = 0
    swa_kv_heads: int = 0
    swa_rope_theta: float = 0.0
    k_eq_v: bool = False
    attn_scale: float = 0.0
    embed_scale: float = 1.0
    logit_softcap: float = 0.0

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.qk_norm not in (None, "head", "full"):
            raise ValueError(f"qk_norm must be None, 'head' or 'full', got {self.qk_norm!r}")
        if self.n_experts:
            if not 0 < self.top_k <= self.n_experts:
                raise ValueError(f"top_k must be in 1..{self.n_experts}, got {self.top_k}")
            if self.expert_intermediate_size <= 0:
                raise ValueError("expert_intermediate_size must be positive for an MoE")
        if not self.sparse_layers:
            object.__setattr__(self, "sparse_layers", (self.n_experts > 0,) * self.n_layers)
        if len(self.sparse_layers) != self.n_layers:
            raise ValueError("sparse_layers must have one entry per layer")
        if self.n_experts == 0 and any(self.sparse_layers):
            raise ValueError("sparse layers need n_experts > 0")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")
        if not self.window_layers:
            object.__setattr__(self, "window_layers", (self.sliding_window > 0,) * self.n_layers)
        if len(self.window_layers) != self.n_layers:
            raise ValueError("window_layers must have one entry per layer")
        if self.router_softmax not in ("all", "topk"):
            raise ValueError(f"router_softmax must be 'all' or 'topk', got {self.router_softmax!r}")
        if self.expert_act not in ("silu", "swiglu_oai", "gelu"):
            raise ValueError(
                f"expert_act must be 'silu', 'swiglu_oai' or 'gelu', got {self.expert_act!r}"
            )
        if self.swa_kv_heads and self.n_heads % self.swa_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of swa_kv_heads ({self.swa_kv_heads})"
            )
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and in 0..{self.head_dim}")
        if self.rope_freq_factors and len(self.rope_freq_factors) != self.rope_dim // 2:
            raise ValueError(f"rope_freq_factors must have {self.rope_dim // 2} entries")
        if not self.linear_layers:
            object.__setattr__(self, "linear_layers", (False,) * self.n_layers)
        if len(self.linear_layers) != self.n_layers:
            raise ValueError("linear_layers must have one entry per layer")
        if any(self.linear_layers):
            dims = ("linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim")
            if min(getattr(self, n) for n in (*dims, "conv_kernel")) <= 0:
                raise ValueError(f"linear attention layers need positive {', '.join(dims)}")
            if self.linear_v_heads % self.linear_k_heads:
                raise ValueError("linear_v_heads must be a multiple of linear_k_heads")

    @property
    def plain_experts(self) -> bool:
        """Experts are SiLU-gated MLPs without biases: what the native, compiled and grouped
        expert kernels compute (the others run eagerly)."""
        return self.expert_act == "silu" and not self.expert_bias

    @property
    def native_act(self) -> str | None:
        """The experts' activation where the native expert kernels compute them (SiLU- or
        GELU-gated, no biases), else None."""
        return (
            self.expert_act
            if self.expert_act in ("silu", "gelu") and not self.expert_bias
            else None
        )

    @property
    def rope_dim(self) -> int:
        """The dims of each head that RoPE rotates."""
        return self.rotary_dim or self.head_dim

    @property
    def attention_layers(self) -> int:
        """Layers with softmax attention: the ones that keep keys and values."""
        return self.n_layers - sum(self.linear_layers)

    @property
    def conv_dim(self) -> int:
        """Channels of a linear attention layer's causal conv: its q, k and v."""
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    @property
    def state_bytes(self) -> int:
        """float32 bytes of one sequence's recurrent state over every linear attention
        layer: the conv's last inputs and the delta rule's [Hv, Dk, Dv] memory."""
        per_layer = self.conv_dim * (self.conv_kernel - 1) + (
            self.linear_v_heads * self.linear_k_dim * self.linear_v_dim
        )
        return 4 * per_layer * sum(self.linear_layers)

    def attn_dims(self, layer: int) -> tuple[int, int]:
        """(KV heads, head width) of softmax attention layer ``layer``."""
        if self.window_layers[layer]:
            return self.swa_kv_heads or self.n_kv_heads, self.swa_head_dim or self.head_dim
        return self.n_kv_heads, self.head_dim

    @property
    def kv_values_per_token(self) -> int:
        """Keys and values one position holds over every softmax attention layer."""
        return sum(
            2 * heads * width
            for layer, (heads, width) in enumerate(map(self.attn_dims, range(self.n_layers)))
            if not self.linear_layers[layer]
        )

    @property
    def is_moe(self) -> bool:
        return any(self.sparse_layers)

    def window(self, layer: int) -> int:
        """The layer's sliding window, 0 where it attends to every earlier position."""
        return self.sliding_window if self.window_layers[layer] else 0

    @property
    def n_routed_experts(self) -> int:
        """Routed experts in the whole model: the units the offloading engine moves."""
        return self.n_experts * sum(self.sparse_layers)
