"""The decoder all supported families share, split into the pieces the engine schedules.

A layer is ``attention_block`` + ``ffn_input`` (+ ``route`` for sparse layers; all of them
as one: ``attention_route``), then for sparse layers ``moe`` (routed experts, fetched one
at a time) + ``shared_expert``, for dense layers ``dense_mlp``. ``forward`` strings them
together as the plain sequential reference.

Legend: T tokens in the batch, D hidden, H heads, G kv heads, Dh head dim,
E experts, K top-k, I expert width, V vocab, S cached positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from backend.kernels import native
from backend.kernels.dense import FusedWeight, dense_linear, rowwise, warm_up_dense
from backend.models import rope
from backend.models.config import ModelConfig
from backend.models.linear_attention import linear_attention
from backend.models.weights import DenseWeights, ExpertRef, ExpertWeights, StoredExpert

GetExpert = Callable[[int, int], ExpertWeights | StoredExpert]

# Attention scores (floats) computed at once for a prompt under attention sinks: 16 M
# floats, 64 MiB, whatever the prompt's length.
SINK_SCORES = 1 << 24


def _sink_softmax(att: torch.Tensor, sinks: torch.Tensor, n: int) -> torch.Tensor:
    """Softmax of scores ``att`` [G, rep*n, S] (kv group, its heads' query rows, keys) with
    each head's sink logit (``sinks`` [H], H = G*rep) as one more key, dropped after:
    gpt-oss's attention sinks, the share of attention that goes to no position."""
    G, rows, _ = att.shape
    sink = sinks.to(att.dtype).view(G, rows // n, 1, 1).expand(G, rows // n, n, 1)
    both = torch.cat((att, sink.reshape(G, rows, 1)), -1)
    return both.softmax(-1)[..., :-1]


@dataclass
class KVCache:
    """One sequence's keys and values, per layer, grown geometrically."""

    n_layers: int
    max_len: int | None = None  # positions this sequence may ever hold (a hard cap on growth)
    k: list[torch.Tensor | None] = field(default_factory=list)
    v: list[torch.Tensor | None] = field(default_factory=list)
    # linear attention layer -> (positions absorbed, conv state, delta-rule state)
    state: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.k = [None] * self.n_layers
        self.v = [None] * self.n_layers

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [G, n, Dh] at positions start.. and return the cached prefix [G, start+n, Dh]."""
        end = start + k.shape[1]
        buf_k, buf_v = self.reserve(layer, start, end, k)
        buf_k[:, start:end] = k
        buf_v[:, start:end] = v
        return buf_k[:, :end], buf_v[:, :end]

    def reserve(
        self, layer: int, start: int, end: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's whole K and V buffers [G, cap, Dh], cap >= ``end``, grown where
        needed keeping positions before ``start``; new ones take ``like``'s [G, *, Dh],
        dtype and device."""
        buf_k, buf_v = self.k[layer], self.v[layer]
        if buf_k is None or buf_k.shape[1] < end:
            cap = max(end, 2 * (0 if buf_k is None else buf_k.shape[1]), 64)
            if self.max_len is not None:
                cap = max(end, min(cap, self.max_len))
            new_k = like.new_empty(like.shape[0], cap, like.shape[-1])
            new_v = like.new_empty(like.shape[0], cap, like.shape[-1])
            if buf_k is not None:
                new_k[:, :start] = buf_k[:, :start]
                new_v[:, :start] = buf_v[:, :start]
            self.k[layer], self.v[layer] = buf_k, buf_v = new_k, new_v
        return buf_k, buf_v

    def recurrent(
        self, layer: int, start: int, shapes: tuple[tuple[int, ...], tuple[int, ...]], device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A linear attention layer's state (conv inputs, delta-rule memory; float32, zeros
        before the first token) as it stands after the sequence's first ``start`` positions.

        Unlike keys and values, a state cannot be read back at an earlier position nor
        written twice: a slice that does not continue where the last one ended is a bug
        in whatever scheduled it, raised here rather than computed wrongly."""
        kept = self.state.get(layer)
        held = 0 if kept is None else kept[0]
        if held != start:
            raise RuntimeError(
                f"layer {layer}'s recurrent state holds {held} positions; a slice at {start} cannot use it"
            )
        if kept is None:
            return tuple(torch.zeros(s, dtype=torch.float32, device=device) for s in shapes)
        return kept[1], kept[2]

    def keep_recurrent(self, layer: int, end: int, conv: torch.Tensor, mem: torch.Tensor) -> None:
        """The layer's state after positions ..end-1 (see ``recurrent``)."""
        self.state[layer] = (end, conv, mem)

    @property
    def nbytes(self) -> int:
        tensors = [*self.k, *self.v, *(t for _, *pair in self.state.values() for t in pair)]
        return sum(t.nbytes for t in tensors if t is not None)


@dataclass
class SeqSlice:
    """``n`` consecutive tokens of one sequence, starting at position ``start``, in a batch."""

    kv: KVCache
    start: int
    n: int


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (transformers' ``gelu_pytorch_tanh``, llama.cpp's GELU)."""
    return F.gelu(x, approximate="tanh")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | float, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def angle_table(
    tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]],
    inv_freq: torch.Tensor,
    scale: float,
    end: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tables[dtype]``, made or grown (by doubling) to cover positions 0..``end``-1:
    cos and sin [P, R/2] of each position times ``inv_freq``, scaled by ``scale``."""
    table = tables.get(dtype)
    if table is None or table[0].shape[0] < end:
        size = max(end, 256, 2 * (0 if table is None else table[0].shape[0]))
        pos = torch.arange(size, device=inv_freq.device).float()
        freqs = pos[:, None] * inv_freq[None, :]  # [P, R/2]
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        table = cos.to(dtype), sin.to(dtype)
        tables[dtype] = table  # one assignment: readers see old or new
    return table


class Transformer:
    def __init__(
        self,
        config: ModelConfig,
        dense: dict[str, torch.Tensor],
        experts: list[list[ExpertRef]],
        device: torch.device,
        dtype: torch.dtype,
        fused: dict[str, FusedWeight] | None = None,
    ) -> None:
        self.config = config
        # (the loader's ``DenseWeights`` holds some weights in their blocks alone)
        self.w = dense if isinstance(dense, DenseWeights) else DenseWeights(dense)
        # Dense weights with compiled kernels for products with few rows (decoding; see
        # ``FusedWeight``): "blk.N.attn_qkv" (q, k, v stacked), "blk.N.attn_output", "head".
        self.fused: dict[str, FusedWeight] = dict(fused or {})
        self.experts = experts
        self.device = device
        self.dtype = dtype
        # Keys and values as the KV cache stores them (``set_kv_type``), read back as
        # ``dtype``: the activations' own, or float16 (llama.cpp's default cache type).
        self.kv_dtype = dtype
        c = config
        # The frequencies, and the factor cos and sin are scaled by (YaRN's; else 1).
        self._inv_freq, self._rope_scale = rope.inv_freq(c, device)
        # dtype -> (cos, sin) [P, Dh/2] for positions 0..P-1 (see ``rope_table``)
        self._rope_tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        # (layer, ffn, router) -> (the weights it was made of, the native attention block's
        # weights or None): see ``_block_weights``
        self._blocks: dict[tuple[int, bool, bool], tuple[tuple, native.BlockWeights | None]] = {}

    def set_kv_type(self, kv_type: str) -> None:
        """Store keys and values as ``kv_type``: "auto" (the activations' dtype), "f16" or
        "f32" (``EngineConfig.kv_type``). float16 halves what a context holds, and
        decoding at long contexts, which reads every cached key and value once per layer,
        takes less time (``docs/performance.md``); the values differ from float32's by
        their rounding. Caches already holding keys keep their dtype: set it before any
        sequence starts."""
        kinds = {"auto": self.dtype, "f16": torch.float16, "f32": torch.float32}
        if kv_type not in kinds:
            raise ValueError(f"kv_type must be one of {', '.join(kinds)}, got {kv_type!r}")
        self.kv_dtype = kinds[kv_type]

    # --- pieces -------------------------------------------------------------------------

    def _fused_linear(self, name: str, x: torch.Tensor) -> torch.Tensor | None:
        """x @ W.T by the compiled kernel of ``name`` if it has one and x has few rows."""
        w = self.fused.get(name)
        return None if w is None else dense_linear(w, x)

    def linear(
        self, name: str, x: torch.Tensor, bias: torch.Tensor | None = None, prompt: bool = False
    ) -> torch.Tensor:
        """x @ w[name].T (+ bias). Decoding rows go through the weight's compiled kernel
        where it has one (each row's bits then independent of its batch-mates); ``prompt``
        rows through BLAS, whose rows are likewise the same bits in any batch of more than
        a few dozen rows (measured: ``docs/performance.md``), so that a prompt computes the
        same alone as batched with others, in the engine's groups as in plain generation."""
        y = None if prompt else self._fused_linear(name, x)
        if y is None:
            return F.linear(x, self.w[name], bias)
        return y if bias is None else y + bias

    def warm_up(self) -> bool:
        """Compile the dense weights' kernels for every row bucket they take (seconds once;
        Inductor's disk cache makes later starts quick). True if all are ready; otherwise
        their products run on BLAS."""
        return all(warm_up_dense(w) for w in self.fused.values())

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.w
        if isinstance(w, DenseWeights):  # (tests may swap in a dict)
            return w.rows("token_embd", ids)  # [T, D]
        return w["token_embd"][ids]

    def held_bytes(self) -> int:
        """Bytes of the dense weights as held: tensors, blocks, kernels' copies (each
        storage once)."""
        w = self.w
        held = w.held() if isinstance(w, DenseWeights) else list(w.values())
        held += [f.data for f in self.fused.values()]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
        return sum(storages.values())

    def rope_table(self, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, Dh/2] of positions 0..P-1, P >= ``end``, grown by doubling.

        A decoding step then slices its angles out instead of computing them (seven small
        ops per attention call). The values are those computed per call before: the same
        float32 product of position and frequency, then cos and sin."""
        return angle_table(self._rope_tables, self._inv_freq, self._rope_scale, end, dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, Dh] rotated by angles cos, sin [T, R/2] (R = ``rope_dim``: the first R
        dims rotate, the rest pass)."""
        rot = self.config.rope_dim
        if rot < x.shape[-1]:
            return torch.cat((self._rope(x[..., :rot], cos, sin), x[..., rot:]), -1)
        c, s = cos[:, None, :], sin[:, None, :]
        if self.config.rope_interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)

    def attention_block(
        self, layer: int, h: torch.Tensor, seqs: Sequence[SeqSlice]
    ) -> torch.Tensor:
        """h + attention(norm(h)) for a batch of sequence slices; writes their KV (or, in
        a linear attention layer, moves their recurrent state on)."""
        c, w, p = self.config, self.w, f"blk.{layer}."
        prompt = any(s.n != 1 for s in seqs)
        if c.linear_layers[layer]:
            x = rms_norm(h, w[p + "attn_norm"], c.rms_eps)
            return h + linear_attention(c, self, layer, x, seqs, prompt)
        T = h.shape[0]
        decoding = self._decoding(h, seqs)
        if decoding and h.dtype == torch.float32:
            done = self._decode_block(layer, h, seqs)
            if done is not None:
                return done[0]
        x = rms_norm(h, w[p + "attn_norm"], c.rms_eps)
        names = ("attn_q", "attn_k", "attn_v")
        qkv = None if prompt else self._fused_linear(p + "attn_qkv", x)
        qk = None  # q and k side by side in one buffer, when nothing but RoPE comes next
        if qkv is None:
            q, k, v = (self.linear(p + n, x, w.get(p + n + ".bias"), prompt) for n in names)
        else:
            kv_width = c.n_kv_heads * c.head_dim
            q_width = c.n_heads * c.head_dim * (2 if c.attn_gate else 1)
            q, k, v = qkv.split((q_width, kv_width, kv_width), -1)
            biases = [w.get(p + n + ".bias") for n in names]
            plain_qk = not c.qk_norm and not c.attn_gate and c.clip_qkv is None
            if plain_qk and biases[0] is None and biases[1] is None:
                qk = qkv[:, : (c.n_heads + c.n_kv_heads) * c.head_dim]
            q, k, v = (t if b is None else t + b for t, b in zip((q, k, v), biases, strict=True))
        gate = None
        if c.attn_gate:  # q_proj wrote [q, gate] per head
            q, gate = q.view(T, c.n_heads, 2 * c.head_dim).split(c.head_dim, -1)
            q, gate = q.reshape(T, -1), gate.reshape(T, -1)
        if c.qk_norm == "full":
            q = rms_norm(q, w[p + "attn_q_norm"], c.rms_eps)
            k = rms_norm(k, w[p + "attn_k_norm"], c.rms_eps)
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q = q.view(T, c.n_heads, c.head_dim)  # [T, H, Dh]
        k = k.view(T, c.n_kv_heads, c.head_dim)  # [T, G, Dh]
        v = v.view(T, c.n_kv_heads, c.head_dim)
        if c.qk_norm == "head":
            q = rms_norm(q, w[p + "attn_q_norm"], c.rms_eps)
            k = rms_norm(k, w[p + "attn_k_norm"], c.rms_eps)
        table = self.rope_table(max(s.start + s.n for s in seqs), q.dtype)
        if len(seqs) == 1:
            cos, sin = (t[seqs[0].start : seqs[0].start + T] for t in table)  # [T, Dh/2]
        else:
            cos, sin = (torch.cat([t[s.start : s.start + s.n] for s in seqs]) for t in table)
        if qk is None:
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        else:  # both in one pass: each op runs once instead of twice
            qk = self._rope(qk.view(T, c.n_heads + c.n_kv_heads, c.head_dim), cos, sin)
            q, k = qk[:, : c.n_heads], qk[:, c.n_heads :]
        out = self._attend(layer, q, k, v, seqs, c.head_dim**-0.5, w.get(p + "attn_sinks"))
        return h + self._attn_output(p, out.reshape(T, -1), gate, prompt)

    def _attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seqs: Sequence[SeqSlice],
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of rows q [T, H, Dh] (RoPE applied) over each sequence's cached keys
        and values and the new ones k, v [T, G, Dh], which it writes: out [T, H, Dh]. Each
        sequence's rows on their own, so a row's result does not depend on its batch."""
        c, T = self.config, q.shape[0]
        H, G, Dh = q.shape[1], k.shape[1], q.shape[2]
        window = c.window(layer)
        if self._decoding(q, seqs) and sinks is None:
            # One native call writes every row's key and value and attends
            # (``native.attention``), instead of the loop below and its torch ops per row.
            like = k.new_empty(G, 0, Dh, dtype=self.kv_dtype)
            caches = [s.kv.reserve(layer, s.start, s.start + 1, like) for s in seqs]
            out = native.attention(q, k, v, caches, [s.start for s in seqs], scale, window)
            if out is not None:
                return out.view(T, H, Dh)
        out = torch.empty(T, H, Dh, dtype=q.dtype, device=q.device)
        row = 0
        rep = H // G
        for s in seqs:
            # The rows' own keys and values too are read back as stored: a prompt then
            # gets the same bits read whole or in slices, and as the native kernel reads.
            kk, vv = s.kv.write(
                layer,
                s.start,
                k[row : row + s.n].transpose(0, 1).to(self.kv_dtype),
                v[row : row + s.n].transpose(0, 1).to(self.kv_dtype),
            )
            # A sliding layer's rows see only the last ``window`` positions up to their own.
            lo = max(0, s.start - window + 1) if window else 0
            if lo:
                kk, vv = kk[:, lo:], vv[:, lo:]
            kk, vv = kk.to(q.dtype), vv.to(q.dtype)
            if s.n == 1 and q.device.type == "cpu" and q.dtype == torch.float32:
                # Decoding: one query per head, no mask. Two batched matmuls and a softmax
                # cost less than SDPA's math path on CPU.
                qq = q[row].view(G, rep, Dh)
                att = torch.bmm(qq, kk.transpose(1, 2)).mul_(scale)
                att = att.softmax(-1) if sinks is None else _sink_softmax(att, sinks, 1)
                out[row] = torch.bmm(att, vv).view(H, Dh)
                row += 1
                continue
            # Fold each kv group's query heads into its query axis: [G, rep*n, Dh]. One
            # batched SDPA over G groups is much faster on CPU than the enable_gqa path.
            qq = (
                q[row : row + s.n]
                .view(s.n, G, rep, Dh)
                .permute(1, 2, 0, 3)
                .reshape(G, rep * s.n, Dh)
            )
            mask = None
            if s.n > 1:
                qpos = torch.arange(s.start, s.start + s.n, device=q.device)[:, None]
                kpos = torch.arange(lo, s.start + s.n, device=q.device)[None, :]
                mask = kpos <= qpos  # [n, S]
                if window:
                    mask &= kpos > qpos - window
                mask = mask.repeat(rep, 1)  # [rep*n, S]
            if sinks is None:
                # (SDPA's own default where it is the scale: the same bits as ever)
                own = None if scale == Dh**-0.5 else scale
                # As [1, G, rows, Dh]: 4-D inputs take the CPU's flash kernel (blocks of
                # queries and keys: no float [rows, S] scores or mask; the boolean mask
                # stays).
                o = F.scaled_dot_product_attention(
                    qq[None], kk[None], vv[None], attn_mask=mask, scale=own
                )[0]
            else:
                o = self._sink_attention(qq, kk, vv, mask, sinks, s.n, scale)
            out[row : row + s.n] = o.view(G, rep, s.n, Dh).permute(2, 0, 1, 3).reshape(s.n, H, Dh)
            row += s.n
        return out

    def _sink_attention(
        self,
        qq: torch.Tensor,
        kk: torch.Tensor,
        vv: torch.Tensor,
        mask: torch.Tensor | None,
        sinks: torch.Tensor,
        n: int,
        scale: float,
    ) -> torch.Tensor:
        """Attention with sinks for ``n`` query rows per head, ``qq`` [G, rep*n, Dh] against
        ``kk``, ``vv`` [G, S, Dh] (``mask`` [rep*n, S] or None): SDPA has no sink, so the
        product and softmax are written out, a block of query rows at a time so that a
        long prompt's scores never need [G, rep*n, S] at once."""
        G, rows, _ = qq.shape
        rep = rows // n
        out = qq.new_empty(qq.shape)
        step = max(1, SINK_SCORES // max(1, G * rep * kk.shape[1]))
        q4 = qq.view(G, rep, n, -1)
        o4 = out.view(G, rep, n, -1)
        m3 = None if mask is None else mask.view(rep, n, -1)
        for i in range(0, n, step):
            j = min(n, i + step)
            att = torch.bmm(q4[:, :, i:j].reshape(G, rep * (j - i), -1), kk.transpose(1, 2))
            att.mul_(scale)
            if m3 is not None:
                att = att.masked_fill(~m3[:, i:j].reshape(rep * (j - i), -1), float("-inf"))
            part = torch.bmm(_sink_softmax(att, sinks, j - i), vv)
            o4[:, :, i:j] = part.view(G, rep, j - i, -1)
        return out

    def _attn_output(
        self, p: str, out: torch.Tensor, gate: torch.Tensor | None, prompt: bool
    ) -> torch.Tensor:
        """The attention output projection of ``out`` [T, H*Dh] (and its bias, if any),
        scaled first by the sigmoid of ``gate`` [T, H*Dh] where the layer has one."""
        if gate is not None:
            out = out * rowwise(torch.sigmoid, gate)
        return self.linear(p + "attn_output", out, self.w.get(p + "attn_output.bias"), prompt)

    def attention_route(
        self, layer: int, h: torch.Tensor, seqs: Sequence[SeqSlice]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``attention_block``, then the FFN's input and, for sparse layers, its routing:
        (h, x, ids, weights), ids and weights None for dense layers. Decoding rows get all
        of it from one native call where it applies (``_decode_block``), in the sequential
        reference and the engine alike."""
        sparse = self.config.sparse_layers[layer]
        done = None
        if h.dtype == torch.float32 and self._decoding(h, seqs):
            done = self._decode_block(layer, h, seqs, ffn=True, router=sparse)
        elif len(seqs) > 1 and any(s.n == 1 for s in seqs) and any(s.n != 1 for s in seqs):
            mixed = self._route_mixed(layer, h, seqs, sparse)
            if mixed is not None:
                return mixed
        if done is None:  # (it tries the native block again, and is refused again)
            h = self.attention_block(layer, h, seqs)
            x, ids, weights = self.ffn_input(layer, h), None, None
        else:
            h, x, _, ids, weights = done
        if not sparse:
            return h, x, None, None
        if ids is None:  # a router the kernel does not take
            ids, weights = self.route(
                layer, self.router_input(layer, h, x), any(s.n != 1 for s in seqs)
            )
        return h, x, ids, weights

    def _route_mixed(
        self, layer: int, h: torch.Tensor, seqs: Sequence[SeqSlice], sparse: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """``attention_route`` for a batch of decoding rows and prompts (a prompt's group
        may take one-token riders): the decoding rows as if alone (through the native
        block where it takes them, else the ops on them alone), so that their results are
        the bits they get in any batch, the prompts through the ops. None where one
        sequence comes twice."""
        if len({id(s.kv) for s in seqs}) != len(seqs):
            return None
        ones = [s for s in seqs if s.n == 1]
        rows: tuple[list[int], list[int]] = ([], [])  # (decoding rows, prompt rows)
        at = 0
        for s in seqs:
            rows[s.n != 1].extend(range(at, at + s.n))
            at += s.n
        done = None
        if h.dtype == torch.float32 and h.device.type == "cpu":
            done = self._decode_block(layer, h[rows[0]], ones, ffn=True, router=sparse)
        if done is None:
            h1 = self.attention_block(layer, h[rows[0]], ones)
            x1, ids1, w1 = self.ffn_input(layer, h1), None, None
        else:
            h1, x1, _, ids1, w1 = done
        h2 = self.attention_block(layer, h[rows[1]], [s for s in seqs if s.n != 1])
        x2 = self.ffn_input(layer, h2)
        out_h, out_x = torch.empty_like(h), torch.empty_like(h)
        ids = weights = None
        for part, hh, xx, top in ((rows[0], h1, x1, ids1), (rows[1], h2, x2, None)):
            idx = torch.tensor(part, device=h.device)
            out_h[idx], out_x[idx] = hh, xx
            if sparse:
                prompt = part is rows[1]
                if top is None:
                    i, w = self.route(layer, self.router_input(layer, hh, xx), prompt)
                else:
                    i, w = top, w1
                if ids is None:
                    ids = i.new_empty(h.shape[0], i.shape[1])
                    weights = w.new_empty(h.shape[0], w.shape[1])
                ids[idx], weights[idx] = i, w
        return out_h, out_x, ids, weights

    @staticmethod
    def _decoding(h: torch.Tensor, seqs: Sequence[SeqSlice]) -> bool:
        """One new token per sequence, each sequence once (a cache reserved twice could
        move between its rows' writes), on the CPU: what the native kernels take."""
        return (
            h.device.type == "cpu"
            and all(s.n == 1 for s in seqs)
            and len({id(s.kv) for s in seqs}) == len(seqs)
        )

    def _decode_block(
        self,
        layer: int,
        h: torch.Tensor,
        seqs: Sequence[SeqSlice],
        ffn: bool = False,
        router: bool = False,
    ) -> tuple[torch.Tensor, ...] | None:
        """A decoding step's whole attention block in one native call (``native.
        attention_block``, instead of the ops below and the Python between them), where the
        layer's projections are stored in blocks the kernels read and it has no biases, q/k
        norms or clipping; else None. Returns (h, x, logits, ids, weights): with ``ffn``, x is
        the FFN's input (``ffn_input``), and with ``router`` too, logits its router's and
        ids, weights its routing (``route``'s selection and weights, computed in the same
        call: the softmax's roundings are the kernel's), each None where the kernel does not
        take the router. Rows routed here route so wherever they run (sequential reference,
        every policy, batched with a prompt), so their results stay the same bits."""
        blk = self._block_weights(layer, ffn, router)
        if blk is None:
            return None
        c = self.config
        like = h.new_empty(c.n_kv_heads, 0, c.head_dim, dtype=self.kv_dtype)
        caches = [s.kv.reserve(layer, s.start, s.start + 1, like) for s in seqs]
        rope = self.rope_table(max(s.start for s in seqs) + 1, h.dtype)
        return native.attention_block(h, blk, rope, caches, [s.start for s in seqs])

    def decode_blocks(self) -> list[native.BlockWeights | None]:
        """Each sparse layer's native attention block with its FFN norm, router and top-k,
        the one ``attention_route`` runs for decoding rows; None for dense layers and where
        the kernels do not take the layer or its router."""
        out = []
        for layer, sparse in enumerate(self.config.sparse_layers):
            blk = self._block_weights(layer, True, True) if sparse else None
            out.append(blk if blk is not None and blk.topk is not None else None)
        return out

    def _block_weights(self, layer: int, ffn: bool, router: bool) -> native.BlockWeights | None:
        """The layer's ``native.BlockWeights``, or None where the native block does not
        take the layer: checked once, then kept while the weights it was made of are still
        the layer's (a caller may swap ``fused`` or ``w``, as the tests' references do)."""
        c, p = self.config, f"blk.{layer}."
        qkv, o = self.fused.get(p + "attn_qkv"), self.fused.get(p + "attn_output")
        sources = (
            qkv,
            o,
            self.w.get(p + "attn_norm"),
            self.w.get(p + "ffn_norm") if ffn else None,
            self.w.get(p + "ffn_gate_inp") if router else None,
        )
        key = (layer, ffn, router)
        kept = self._blocks.get(key)
        if kept is not None and all(a is b for a, b in zip(kept[0], sources, strict=True)):
            return kept[1]
        blk = None
        if not (
            qkv is None
            or o is None
            or qkv.data.dtype != torch.uint8
            or o.data.dtype != torch.uint8
            or c.qk_norm
            or c.clip_qkv is not None
            or any(p + n + ".bias" in self.w for n in ("attn_q", "attn_k", "attn_v", "attn_output"))
            or c.attn_sinks
            or c.attn_gate
            or c.rope_dim != c.head_dim
            or c.linear_layers[layer]
            or (router and (c.router_bias or c.router_softmax != "all"))
        ):
            blk = native.BlockWeights(
                self.w[p + "attn_norm"],
                c.rms_eps,
                (qkv.data, qkv.qtype),
                (o.data, o.qtype),
                (c.n_heads, c.n_kv_heads, c.head_dim),
                c.rope_interleaved,
                (self.w[p + "ffn_norm"], self.w[p + "ffn_gate_inp"] if router else None)
                if ffn
                else None,
                (c.top_k, c.norm_topk_prob) if router else None,
                c.window(layer),
            )
            blk = blk if blk.ok else None
        self._blocks[key] = (sources, blk)
        return blk

    def ffn_input(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The input of the layer's FFN (its routed experts' in a sparse layer)."""
        return rms_norm(h, self.w[f"blk.{layer}.ffn_norm"], self.config.rms_eps)

    def router_input(self, layer: int, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """What the layer's router reads, given the residual ``h`` after attention and the
        experts' input ``x``: x (Gemma 4's router normalizes h its own way)."""
        return x

    def route(
        self, layer: int, x: torch.Tensor, prompt: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [T, K] and weights [T, K] (softmax over all, then top-k; or
        ``router_softmax`` "topk": top-k of the logits, then their softmax) of decoding
        rows, or of a prompt's (see ``linear``)."""
        p = f"blk.{layer}.ffn_gate_inp"
        logits = self.linear(p, x, self.w.get(p + ".bias"), prompt).float()  # [T, E]
        if self.config.router_softmax == "topk":
            top, ids = logits.topk(self.config.top_k, dim=-1)
            return ids, top.softmax(-1).to(x.dtype)
        probs = logits.softmax(-1)
        weights, ids = probs.topk(self.config.top_k, dim=-1)
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights.to(x.dtype)

    @staticmethod
    def silu_mlp(weights: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate x) * up x): every dense and shared MLP, and the plain experts."""
        gate, up, down = weights
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

    def expert_mlp(
        self, weights: ExpertWeights, x: torch.Tensor, layer: int = -1, e: int = -1
    ) -> torch.Tensor:
        """The MLP of rows ``x``: SiLU-gated, or for routed expert ``e`` of ``layer`` with
        ``expert_bias``/``expert_act`` its biases and gpt-oss's clamped SwiGLU."""
        c = self.config
        if c.plain_experts:
            return self.silu_mlp(weights, x)
        gate, up, down = weights
        if e < 0:
            raise ValueError("these experts have biases: expert_mlp needs the layer and expert")
        p, w = f"blk.{layer}.", self.w
        bias = (w[p + f"ffn_{n}_exps.bias"][e] for n in ("gate", "up", "down"))
        g, u, d = bias if c.expert_bias else (None, None, None)
        g, u = F.linear(x, gate, g), F.linear(x, up, u)
        if c.expert_act == "gelu":
            act = rowwise(gelu_tanh, g) * u
        elif c.expert_act == "swiglu_oai":
            g = g.clamp(max=c.swiglu_limit)
            u = u.clamp(min=-c.swiglu_limit, max=c.swiglu_limit)
            act = (u + 1) * (g * torch.sigmoid(g * c.swiglu_alpha))
        else:
            act = F.silu(g) * u
        return F.linear(act, down, d)

    def moe(
        self,
        layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        get_expert: GetExpert,
    ) -> torch.Tensor:
        """Sum over each token's routed experts, one expert at a time: [T, D]."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            expert = get_expert(layer, e)
            if isinstance(expert, StoredExpert):  # the kernel on its bytes, up to its rows
                y = expert(x[rows]) if self.config.native_act else None
                expert = expert.weights() if y is None else None
            if expert is not None:
                y = self.expert_mlp(expert, x[rows], layer, e)
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out

    def shared_expert(
        self, layer: int, x: torch.Tensor, prompt: bool = False
    ) -> torch.Tensor | None:
        """The sigmoid-gated shared expert of decoding rows ``x``, or of a prompt's."""
        if not self.config.shared_expert_size:
            return None
        p = f"blk.{layer}."
        gate = self.linear(p + "ffn_gate_shexp", x, prompt=prompt)
        up = self.linear(p + "ffn_up_shexp", x, prompt=prompt)
        y = self.linear(p + "ffn_down_shexp", rowwise(F.silu, gate) * up, prompt=prompt)
        # Its gate is one output: a sum per row (BLAS rounds a one-column product by how
        # many rows there are, even past the few dozen where it rounds wider ones alike).
        gate_logit = (x * self.w[p + "ffn_gate_inp_shexp"]).sum(-1, keepdim=True)
        return rowwise(torch.sigmoid, gate_logit) * y

    def dense_mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        p = f"blk.{layer}."
        return self.silu_mlp(
            (self.w[p + "ffn_gate"], self.w[p + "ffn_up"], self.w[p + "ffn_down"]), x
        )

    def ffn_block(
        self,
        layer: int,
        h: torch.Tensor,
        routed: Sequence[torch.Tensor | None],
        get_expert: GetExpert,
        prompt: bool = False,
    ) -> torch.Tensor:
        """h + the FFN of x, ``routed`` = (x, ids, weights) from ``attention_route`` (of
        decoding rows, or of prompts: see ``linear``)."""
        x, ids, weights = routed
        sparse = self.config.sparse_layers[layer]
        y = self.moe(layer, x, ids, weights, get_expert) if sparse else None
        return self.ffn_output(layer, h, x, y, prompt)

    def ffn_output(
        self, layer: int, h: torch.Tensor, x: torch.Tensor, y: torch.Tensor | None, prompt: bool
    ) -> torch.Tensor:
        """The layer's output from the residual ``h``, the FFN's input ``x`` and, in a
        sparse layer, its routed experts' weighted sum ``y``: h + the dense MLP of x, or
        h + y + the shared expert of x (of decoding rows, or of a prompt's)."""
        if not self.config.sparse_layers[layer]:
            return h + self.dense_mlp(layer, x)
        shared = self.shared_expert(layer, x, prompt)
        return h + (y if shared is None else y + shared)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        x = rms_norm(h, self.w["output_norm"], self.config.rms_eps)
        n = x.shape[0]
        y = self._fused_linear("head", x)
        if y is not None:
            return y.float()
        head = self.w["token_embd"] if self.config.tie_embeddings else self.w["output"]
        if x.device.type == "cpu" and n > 1 and n % 4:
            # Without the compiled kernel (more rows than it takes, or no compiler): the
            # CPU BLAS is slower for some row counts (2, 3, 7) against a wide matrix than
            # for the next multiple of 4: zero rows pad the batch to one.
            x = torch.cat([x, x.new_zeros(4 - n % 4, x.shape[1])])
        return F.linear(x, head).float()[:n]  # [T, V]

    # --- the sequential reference ------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        seqs: Sequence[SeqSlice],
        get_expert: GetExpert,
        last_only: bool = True,
    ) -> torch.Tensor:
        """Logits for a batch of sequence slices (each slice's last token if ``last_only``)."""
        h = self.embed(ids)
        prompt = any(s.n != 1 for s in seqs)
        for layer in range(self.config.n_layers):
            h, *routed = self.attention_route(layer, h, seqs)
            h = self.ffn_block(layer, h, routed, get_expert, prompt)
        if last_only:
            ends = torch.tensor([0] + [s.n for s in seqs], device=h.device).cumsum(0)[1:] - 1
            h = h[ends]
        return self.logits(h)
