"""Gated DeltaNet, the linear attention of Qwen3.5's hybrid stack.

Each sequence carries, per linear layer, two states instead of keys and values: the
causal conv's last K-1 inputs and the delta rule's memory S [Hv, Dk, Dv]. Token t
decays the memory by exp(g_t), writes its value where its key points, corrected by what
the memory already predicted there (the delta rule: u = beta (v - k^T S)), and reads it
with its query: S <- e^g S + k u^T, o = q^T S.

A prompt runs in chunks of ``CHUNK`` tokens with the same result as token by token: the
chunk's corrections u solve one unit lower-triangular system (each correction depends on
those before it through k_j . k_m), after which its outputs and the memory it leaves are
matrix products. Within a chunk, decays enter only as exp(G_i - G_j) for j <= i and
exp(G_i) (G the running sum of g <= 0), so nothing overflows. Decoding rows of every
sequence in a batch take one stacked step (``_decode_step``).

Legend: n tokens of one sequence, C conv channels (q, k, v), K conv kernel, Hk/Hv key and
value heads (each key head serves Hv/Hk consecutive value heads), Dk/Dv their widths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from backend.kernels.dense import rowwise

if TYPE_CHECKING:
    from backend.models.config import ModelConfig
    from backend.models.transformer import SeqSlice, Transformer

CHUNK = 64


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU of the depthwise causal conv of ``x`` [C, n] continuing after ``state``
    [C, K-1] (the inputs before it), ``weight`` [C, K]; returns [C, n] and leaves the
    last K-1 inputs in ``state``."""
    full = torch.cat((state, x), 1)  # [C, K-1+n]
    y = F.conv1d(full[None], weight[:, None, :], groups=weight.shape[0])[0]
    state.copy_(full[:, full.shape[1] - state.shape[1] :])
    return F.silu(y)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    mem: torch.Tensor,
) -> torch.Tensor:
    """Outputs [H, n, Dv] of the gated delta rule for q, k [H, n, Dk] (normalized, q
    scaled), v [H, n, Dv], log-decays g and write strengths beta [H, n], from memory
    ``mem`` [H, Dk, Dv], which it leaves holding the state after the last token."""
    H, n, _ = q.shape
    out = v.new_empty(H, n, v.shape[-1])
    for i in range(0, n, CHUNK):
        j = min(n, i + CHUNK)
        qc, kc, vc, bc = q[:, i:j], k[:, i:j], v[:, i:j], beta[:, i:j]
        G = g[:, i:j].cumsum(-1)  # [H, m]
        m = j - i
        causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
        decay = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        # Row r of the system: u_r + sum_{s<r} beta_r e^{G_r-G_s} (k_r.k_s) u_s
        #                      = beta_r (v_r - e^{G_r} k_r^T S0)
        lower = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay).tril(-1)
        system = lower + torch.eye(m, dtype=q.dtype, device=q.device)
        rhs = torch.cat((bc[..., None] * vc, (bc * G.exp())[..., None] * kc), -1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u = solved[..., : vc.shape[-1]] - solved[..., vc.shape[-1] :] @ mem  # [H, m, Dv]
        att = (qc @ kc.transpose(1, 2)) * decay  # [H, m, m]
        out[:, i:j] = (G.exp()[..., None] * qc) @ mem + att @ u
        last = G[:, -1:]  # [H, 1]
        written = (kc * (last - G).exp()[..., None]).transpose(1, 2) @ u  # [H, Dk, Dv]
        mem.mul_(last.exp()[..., None]).add_(written)
    return out


def _decode_step(
    c: ModelConfig,
    layer: int,
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_w: torch.Tensor,
    seqs: Sequence[SeqSlice],
    shapes: tuple[tuple[int, ...], tuple[int, ...]],
) -> torch.Tensor:
    """One new token for each of B sequences ``seqs`` (qkv [B, C], g and beta [B, Hv]),
    their states stacked so that each op runs once for all: [B, Hv, Dv]. Each sequence's
    bits do not depend on B: the conv is a sum per channel, the matmuls are per (sequence,
    head) (a batched matmul computes each alike, measured), and the flat exp and SiLU go
    through ``rowwise``; every decoding step of every batch takes this path."""
    Hk, Hv, Dk, Dv = c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim
    B = len(seqs)
    states = [s.kv.recurrent(layer, s.start, shapes, qkv.device) for s in seqs]
    full = torch.cat((torch.stack([conv for conv, _ in states]), qkv[:, :, None]), 2)  # [B, C, K]
    mixed = rowwise(F.silu, (full * conv_w).sum(-1))  # [B, C]
    q, k, v = mixed.split((Hk * Dk, Hk * Dk, Hv * Dv), -1)
    q, k = (_l2norm(m.reshape(B, Hk, Dk)) for m in (q, k))
    q = q * Dk**-0.5
    q, k = (m.repeat_interleave(Hv // Hk, 1) for m in (q, k))  # [B, Hv, Dk]
    S = torch.stack([mem for _, mem in states]) * rowwise(torch.exp, g)[..., None, None]
    u = beta[..., None, None] * (v.reshape(B, Hv, 1, Dv) - k[:, :, None, :] @ S)
    new = S + k[..., None] @ u  # [B, Hv, Dk, Dv]
    for i, (s, (conv, mem)) in enumerate(zip(seqs, states, strict=True)):
        conv.copy_(full[i, :, 1:])
        mem.copy_(new[i])
        s.kv.keep_recurrent(layer, s.start + 1, conv, mem)
    return (q[:, :, None, :] @ new)[:, :, 0]


def linear_attention(
    c: ModelConfig,
    t: Transformer,
    layer: int,
    x: torch.Tensor,
    seqs: Sequence[SeqSlice],
    prompt: bool = False,
) -> torch.Tensor:
    """The Gated DeltaNet of ``layer`` on normed rows ``x`` [T, D] of a batch of sequence
    slices, each moving its own state on: [T, D]. Its products go through ``t.linear``
    (compiled row kernels for decoding rows), the input projections of q, k, v and the
    gate z as one where they are stacked ("ssm_in"); ``prompt`` rows through BLAS."""
    p, w = f"blk.{layer}.", t.w
    Hk, Hv, Dk, Dv = c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim
    both = None if prompt else t._fused_linear(p + "ssm_in", x)
    if both is None:
        qkv, z = (
            t.linear(p + "attn_qkv", x, None, prompt),
            t.linear(p + "attn_gate", x, None, prompt),
        )
    else:
        qkv, z = both.split((c.conv_dim, Hv * Dv), -1)
    qkv, z = qkv.float(), z.float().view(-1, Hv, Dv)  # [T, C], [T, Hv, Dv]
    # (The batch's gates through ``rowwise``: a row's bits must not depend on its batch.)
    beta = rowwise(torch.sigmoid, t.linear(p + "ssm_beta", x, None, prompt).float())  # [T, Hv]
    # ssm_a holds -exp(A_log): g = -exp(A_log) softplus(a + dt_bias), a log-decay <= 0
    a = t.linear(p + "ssm_alpha", x, None, prompt).float() + w[p + "ssm_dt.bias"].float()
    g = w[p + "ssm_a"].float() * rowwise(F.softplus, a)
    conv_w = w[p + "ssm_conv1d"].float()
    shapes = ((c.conv_dim, c.conv_kernel - 1), (Hv, Dk, Dv))
    if all(s.n == 1 for s in seqs):
        out = _decode_step(c, layer, qkv, g, beta, conv_w, seqs, shapes)
    else:
        out = torch.empty(x.shape[0], Hv, Dv, dtype=torch.float32, device=x.device)
        row = 0
        for s in seqs:
            rows = slice(row, row + s.n)
            conv, mem = s.kv.recurrent(layer, s.start, shapes, x.device)
            mixed = causal_conv(qkv[rows].T, conv, conv_w).T  # [n, C]
            q, k, v = mixed.split((Hk * Dk, Hk * Dk, Hv * Dv), -1)
            q, k = (_l2norm(m.reshape(s.n, Hk, Dk)) for m in (q, k))
            q = q * Dk**-0.5
            q, k = (m.repeat_interleave(Hv // Hk, 1).transpose(0, 1) for m in (q, k))
            v = v.reshape(s.n, Hv, Dv).transpose(0, 1)
            o = delta_rule(q, k, v, g[rows].T, beta[rows].T, mem)  # [Hv, n, Dv]
            s.kv.keep_recurrent(layer, s.start + s.n, conv, mem)
            out[rows] = o.transpose(0, 1)
            row += s.n
    # RMSNorm per value head (weight ssm_norm), then the SiLU gate z.
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + c.rms_eps)
    y = ((w[p + "ssm_norm"].float() * normed) * rowwise(F.silu, z)).reshape(x.shape[0], Hv * Dv)
    return t.linear(p + "ssm_out", y.to(x.dtype), None, prompt)
