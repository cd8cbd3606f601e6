"""Load a GGUF file or an HF folder into a ``LoadedModel`` (dense part resident, experts by reference)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.errors import ModelLoadError
from backend.formats.gguf import GGUFFile, is_gguf, read_gguf
from backend.formats.safetensors import HFFolder, is_hf_folder, read_hf_folder
from backend.formats.tensors import MappedFiles, TensorRef
from backend.kernels import native
from backend.kernels.dense import FusedWeight, block_kernel
from backend.kernels.quants import QType, block_shape
from backend.models import registry
from backend.models.common import (
    Family,
    check_expert,
    check_shape,
    expected_shapes,
    gguf_name,
    with_sparse_layers,
)
from backend.models.config import ModelConfig
from backend.models.transformer import Transformer
from backend.models.weights import DenseWeights, ExpertRef, ResidentExperts

Progress = Callable[[int, int], None]

# Gemma 4's dense products of a layer (``gemma4.Gemma4Transformer`` runs them itself).
GEMMA4_LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

# Gated DeltaNet layers: our (llama.cpp's) names -> transformers' under ``linear_attn``,
# and the parameters transformers keeps without a suffix.
_HF_LINEAR = {
    "attn_qkv": "in_proj_qkv",
    "attn_gate": "in_proj_z",
    "ssm_beta": "in_proj_b",
    "ssm_alpha": "in_proj_a",
    "ssm_conv1d": "conv1d",
    "ssm_norm": "norm",
    "ssm_out": "out_proj",
}
_HF_BARE = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    transformer: Transformer
    experts: list[list[ExpertRef]]  # [layer][expert]; empty list for dense layers
    files: MappedFiles
    tokenizer: object | None  # backend.text.tokenizer.Tokenizer
    quant: str
    size_bytes: int
    dense_refs: dict[str, TensorRef]  # canonical name -> where the resident weight came from

    def resident_experts(self, budget_mib: int = 3072, native: bool = False) -> ResidentExperts:
        """The experts for plain generation; with ``native``, Q4 ones applied from their
        stored bytes where the kernels build (``ResidentExperts``)."""
        t = self.transformer
        return ResidentExperts(
            self.files,
            self.experts,
            t.dtype,
            t.device,
            budget_mib << 20,
            native=native,
            act=t.config.native_act,
        )


def _gguf_layout(
    g: GGUFFile,
) -> tuple[Family, ModelConfig, Callable[[str], str], Callable[[int, int], tuple[TensorRef, ...]]]:
    has_experts = int(g.get("expert_count", 0) or 0) > 0
    fam = registry.gguf_family(g.arch, has_experts)
    if fam is None:
        known = ", ".join(registry.GGUF_ARCHITECTURES)
        raise ModelLoadError(g.path, f"unknown architecture {g.arch!r} (supported: {known})")
    try:
        config = fam.config_from_gguf(g)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(g.path, f"invalid or missing {g.arch} metadata ({exc})") from None
    config = with_sparse_layers(config, lambda i: f"blk.{i}.ffn_gate_inp.weight" in g.tensors)
    for i in range(config.n_layers):
        fused = g.tensors.get(f"blk.{i}.ffn_gate_exps.weight")
        if fused is not None and fused.shape[0] != config.n_experts:
            raise ModelLoadError(
                g.path,
                f"blk.{i}.ffn_gate_exps holds {fused.shape[0]} experts, metadata says {config.n_experts}",
            )

    def name(canonical: str) -> str:
        return gguf_name(fam, canonical)

    def expert(layer: int, e: int) -> tuple[TensorRef, ...]:
        p = f"blk.{layer}."
        if p + "ffn_gate_up_exps.weight" in g.tensors:  # llama.cpp's --fuse-gate-up-exps
            gate_up = g.tensors[p + "ffn_gate_up_exps.weight"]
            return _fused_gate_up(gate_up, g.tensors[p + "ffn_down_exps.weight"], e)
        if p + "ffn_gate_exps.weight" in g.tensors:
            fused = [g.tensors[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down")]
            return tuple(
                TensorRef(
                    t.path,
                    t.offset + e * (t.nbytes // t.shape[0]),
                    t.nbytes // t.shape[0],
                    t.qtype,
                    t.shape[1:],
                )
                for t in fused
            )
        return tuple(g.tensors[p + f"ffn_{n}.{e}.weight"] for n in ("gate", "up", "down"))

    return fam, config, name, expert


def _hf_layout(
    h: HFFolder,
) -> tuple[Family, ModelConfig, Callable[[str], str], Callable[[int, int], tuple[TensorRef, ...]]]:
    archs = h.config.get("architectures") or []
    fam = next((f for a in archs if (f := registry.hf_family(a))), None)
    if fam is None:
        known = ", ".join(registry.HF_ARCHITECTURES)
        raise ModelLoadError(
            h.path / "config.json", f"unknown architecture {archs} (supported: {known})"
        )
    try:
        config = fam.config_from_hf(h.config)
    except KeyError as exc:
        raise ModelLoadError(h.path / "config.json", f"missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(h.path / "config.json", str(exc)) from None
    moe = fam.hf_moe_prefix
    # Multimodal checkpoints keep the text model under model.language_model (the vision
    # tower and multi-token-prediction head beside it are not read).
    root = "model.language_model." if "model.language_model.norm.weight" in h.tensors else "model."
    layers = f"{root}layers."
    attn = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
    }
    attn |= {
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "attn_norm": "input_layernorm",
    }
    attn |= {"ffn_norm": "post_attention_layernorm", "ffn_gate_inp": f"{moe}.gate"}
    attn |= {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    attn |= {f"ffn_{n}_shexp": f"mlp.shared_expert.{n}_proj" for n in ("gate", "up", "down")}
    attn["ffn_gate_inp_shexp"] = "mlp.shared_expert_gate"
    attn |= {ours: f"linear_attn.{theirs}" for ours, theirs in _HF_LINEAR.items()}
    top = {
        "token_embd": root + "embed_tokens.weight",
        "output_norm": root + "norm.weight",
        "output": "lm_head.weight",
    }

    def name(canonical: str) -> str:
        if canonical in top:
            return top[canonical]
        _, layer, rest = canonical.split(".", 2)
        if rest in fam.hf_names:
            return f"{root}layers.{layer}.{fam.hf_names[rest]}"
        if rest in _HF_BARE:
            return f"{root}layers.{layer}.{_HF_BARE[rest]}"
        base, _, suffix = rest.partition(".")
        return f"{root}layers.{layer}.{attn[base]}.{suffix or 'weight'}"

    config = with_sparse_layers(config, lambda i: name(f"blk.{i}.ffn_gate_inp") in h.tensors)

    def expert(layer: int, e: int) -> tuple[TensorRef, ...]:
        p = f"{layers}{layer}.{moe}{'.' if moe else ''}experts."
        if p + "gate_up_proj" in h.tensors:
            return _fused_gate_up(h.tensors[p + "gate_up_proj"], h.tensors[p + "down_proj"], e)
        return tuple(h.tensors[f"{p}{e}.{n}.weight"] for n in fam.hf_expert_names)

    return fam, config, name, expert


def _fused_gate_up(gate_up: TensorRef, down: TensorRef, e: int) -> tuple[TensorRef, ...]:
    """Expert ``e`` of fused tensors gate_up [E, 2I, D] (gate's rows, then up's; as
    transformers keeps them, and llama.cpp's ``ffn_gate_up_exps``) and down [E, D, I]:
    each part is one byte range (rows are whole blocks in every GGUF type)."""
    if len(gate_up.shape) != 3 or len(down.shape) != 3 or gate_up.shape[1] % 2:
        raise KeyError(f"experts.gate_up_proj {list(gate_up.shape)}")
    per, rows = gate_up.nbytes // gate_up.shape[0], gate_up.shape[1] // 2
    at = gate_up.offset + e * per
    half = (rows, gate_up.shape[2])
    down_per = down.nbytes // down.shape[0]
    return (
        TensorRef(gate_up.path, at, per // 2, gate_up.qtype, half),
        TensorRef(gate_up.path, at + per // 2, per // 2, gate_up.qtype, half),
        TensorRef(down.path, down.offset + e * down_per, down_per, down.qtype, down.shape[1:]),
    )


@dataclass
class ModelInfo:
    """What a model file says about itself, read from headers only (nothing loaded)."""

    path: Path
    config: ModelConfig
    dense_refs: dict[str, TensorRef]
    experts: list[list[ExpertRef]]
    quant: str
    size_bytes: int
    source: GGUFFile | HFFolder

    @property
    def name(self) -> str:
        return self.path.stem if self.path.is_file() else self.path.name


def inspect_model(path: str | os.PathLike) -> ModelInfo:
    """Read headers and check every tensor's shape against the config."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(path, "no such file or folder")
    if path.is_file() and is_gguf(path):
        src: GGUFFile | HFFolder = read_gguf(path)
        _, config, name, expert = _gguf_layout(src)
    elif is_hf_folder(path):
        src = read_hf_folder(path)
        _, config, name, expert = _hf_layout(src)
    elif path.is_file():
        raise ModelLoadError(path, "not a GGUF file (bad magic) and not a model folder")
    else:
        raise ModelLoadError(
            path, "folder has no config.json (expected a Hugging Face model folder)"
        )
    refs: dict[str, TensorRef] = {}
    for canonical, want in expected_shapes(config).items():
        key = name(canonical)
        if key not in src.tensors:
            raise ModelLoadError(path, f"missing tensor {key}")
        refs[canonical] = check_shape(path, key, src.tensors[key], want)
    experts: list[list[ExpertRef]] = []
    for layer in range(config.n_layers):
        row = []
        for e in range(config.n_experts if config.sparse_layers[layer] else 0):
            try:
                gate, up, down = expert(layer, e)
            except KeyError as exc:
                raise ModelLoadError(path, f"missing expert tensor {exc.args[0]}") from None
            ref = ExpertRef(layer, e, gate, up, down)
            check_expert(path, config, ref)
            row.append(ref)
        experts.append(row)
    all_refs = list(src.tensors.values())
    # Name the file by its main weight type: the one holding the most bytes among the
    # quantized tensors (norms and routers stay F32 even in quantized files).
    by_bytes: Counter[str] = Counter()
    for r in all_refs:
        by_bytes[r.qtype.name] += r.nbytes
    quantized = Counter({k: v for k, v in by_bytes.items() if k not in ("F32", "F16", "BF16")})
    quant = (quantized or by_bytes).most_common(1)[0][0]
    size = (
        path.stat().st_size
        if path.is_file()
        else sum(p.stat().st_size for p in {r.path for r in all_refs})
    )
    return ModelInfo(path, config, refs, experts, quant, size, src)


def load_model(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
) -> LoadedModel:
    """Inspect, then load the dense part onto ``device``; experts stay in the file."""
    info = inspect_model(path)
    device = torch.device(device)
    files = MappedFiles()
    dense = DenseWeights()
    fix = registry.family(info.config.family).fix_tensor
    from_gguf = isinstance(info.source, GGUFFile)
    as_stored: set[str] = set()  # the file's values, not changed by the family's fix
    fused_kernels = device.type == "cpu" and dtype == torch.float32
    # Weights in blocks alone only where the native kernels read them for every row count
    # (the compiled graphs take decoding rows only, and may fail to build).
    hold = fused_kernels and native.available()
    for i, (canonical, ref) in enumerate(info.dense_refs.items()):
        if hold and fix is None and len(ref.shape) == 2 and block_kernel(ref.qtype):
            # Not decoded now: a kernel may read it from its blocks (``_fused_dense``).
            dense.keep_blocks(canonical, files.bytes_of(ref), ref.qtype, ref.shape)
            as_stored.add(canonical)
        else:
            t = files.load(ref, dtype, device)
            dense[canonical] = t if fix is None else fix(info.config, canonical, t, from_gguf)
            if dense[canonical] is t:
                as_stored.add(canonical)
        if progress:
            progress(i + 1, len(info.dense_refs))
    fused: dict[str, FusedWeight] = {}
    if fused_kernels:
        fused, blocks = _fused_dense(info, files, dense)
        # Weights a kernel reads from their blocks are held in those blocks alone (the
        # kernel's copy, not the file's map, whose pages may be dropped); the others as
        # float32.
        for name in dense:
            if hold and name in blocks and name in as_stored:
                dense.keep_blocks(name, *blocks[name])
            elif name == "token_embd" and dense.in_blocks(name):
                # An untied embedding: only looked up by rows, which decode alone.
                raw, qtype, shape = dense.blocks(name)
                dense.keep_blocks(name, raw.clone(), qtype, shape)
            elif dense.in_blocks(name):
                dense[name] = dense[name]
    cls = registry.family(info.config.family).transformer or Transformer
    transformer = cls(info.config, dense, info.experts, device, dtype, fused)
    tokenizer = _tokenizer(info.path, info.source)
    files.release()  # what the load read is copied out (measured: docs/performance.md)
    return LoadedModel(
        info.path,
        info.config,
        transformer,
        info.experts,
        files,
        tokenizer,
        info.quant,
        info.size_bytes,
        info.dense_refs,
    )


def _fused_dense(
    info: ModelInfo, files: MappedFiles, dense: DenseWeights
) -> tuple[dict[str, FusedWeight], dict[str, tuple[torch.Tensor, QType, tuple[int, int]]]]:
    """The dense weights decoding reads, with few-row kernels (see ``Transformer.fused``):
    each layer's q/k/v (stacked where they share a type) and output projection, the LM
    head, and the products decoding rows would otherwise take to BLAS outside the native
    attention block (routers, shared experts, Gated DeltaNet projections, Qwen3.5's
    attention). Each is held in its stored blocks where a kernel reads them
    (``block_kernel``), else as its float copy. Also returns, for each weight held so, the
    slice of those blocks that is its own, by name (what ``DenseWeights.keep_blocks``
    takes)."""
    refs = info.dense_refs
    blocks: dict[str, tuple[torch.Tensor, QType, tuple[int, int]]] = {}

    def part(name: str) -> tuple[torch.Tensor, QType, tuple[int, int]]:
        ref = refs[name]
        return files.bytes_of(ref), ref.qtype, (ref.shape[0], ref.shape[1])

    def stack(key: str, names: list[str]) -> bool:
        """``names`` stacked from their blocks as ``out[key]``, if a kernel reads them."""
        parts = [part(n) for n in names]
        fw = FusedWeight.stacked(parts)
        if fw is None:
            return False
        out[key] = fw
        at = 0
        for n, (raw, qtype, shape) in zip(names, parts, strict=True):
            blocks[n] = (fw.data[at : at + raw.numel()], qtype, shape)
            at += raw.numel()
        return True

    def linear_part(name: str) -> tuple[torch.Tensor, QType, tuple[int, int]] | None:
        """``part`` of a Gated DeltaNet weight, its value heads as ``fix_tensor`` puts
        them (in a GGUF they are tiled)."""
        raw, qtype, shape = part(name)
        if isinstance(info.source, GGUFFile) and qtype != QType.F32:
            if block_shape(qtype)[0] != 32:  # (its columns move in blocks of 32)
                return None
            from backend.models.qwen3_5_moe import untiled_blocks

            raw = untiled_blocks(info.config, name.split(".")[2], raw, shape[0])
        return None if raw is None else (raw, qtype, shape)

    def rows(name: str, stored: bool = True) -> None:
        """``name`` through a row kernel where nothing faster covers it (its blocks' if
        ``stored`` and a kernel reads them, else the float32 one; not ``stored`` where the
        model computes with other values, as a GGUF's tiled value heads, or needs its float
        copy anyway, as a router): a decoding row's product is then the same bits in any
        batch (BLAS rounds a few rows by how many there are), so the engine's tokens are
        plain generation's."""
        if name in out or len(refs[name].shape) != 2 or (stored and stack(name, [name])):
            return
        t = dense[name]
        out[name] = FusedWeight(t, QType.F32, (t.shape[0], t.shape[1]))

    c = info.config
    out: dict[str, FusedWeight] = {}
    for layer in range(c.n_layers):
        p = f"blk.{layer}."
        if c.sparse_layers[layer]:
            # (the router as float32 always: the native attention block takes it so)
            if p + "ffn_gate_inp" in dense:
                rows(p + "ffn_gate_inp", stored=False)
            for n in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"):
                if p + n in dense:
                    rows(p + n)
        if c.linear_layers[layer]:
            # A Gated DeltaNet's input projections of q, k, v and of its output gate as one,
            # and its output projection.
            parts = [linear_part(p + n) for n in ("attn_qkv", "attn_gate", "ssm_out")]
            if parts[0] and parts[1] and (both := FusedWeight.stacked(parts[:2])):
                out[p + "ssm_in"] = both
            if parts[2] and (proj := FusedWeight.stacked(parts[2:])):
                out[p + "ssm_out"] = proj
            for n in ("attn_qkv", "attn_gate", "ssm_out", "ssm_beta", "ssm_alpha"):
                if n in ("attn_qkv", "attn_gate") and p + "ssm_in" in out:
                    continue
                rows(p + n, stored=False)  # (a GGUF's value heads are tiled)
            continue
        if c.family == "gemma4":  # its own attention and MLP: the ops take every row
            for name in (p + n for n in GEMMA4_LINEAR):
                if name in dense:
                    rows(name)
            continue
        names = [p + n for n in ("attn_q", "attn_k", "attn_v", "attn_output")]
        stack(p + "attn_output", names[3:])
        if not stack(p + "attn_qkv", names[:3]):
            # Of different types (a Q4_K_M file's Q6_K v): each from its own blocks.
            for n in names[:3]:
                if block_kernel(refs[n].qtype) or c.attn_gate:
                    rows(n)
        if c.attn_gate:  # (no native block for Qwen3.5's attention: the ops take every row)
            rows(p + "attn_output")
    name = "token_embd" if info.config.tie_embeddings else "output"
    # From its blocks where a kernel reads them (Q8_0 in most GGUF files: 34 bytes per 32
    # values, ~30 MB for SmolLM2's [49152, 576] head, against 113 MB of float32).
    if not stack("head", [name]):
        head = dense[name]
        out["head"] = FusedWeight(head, QType.F32, (head.shape[0], head.shape[1]))
    return out, blocks


def _tokenizer(path: Path, src: GGUFFile | HFFolder) -> object | None:
    """The model's tokenizer, or None for weight-only files (tiny test models)."""
    if isinstance(src, GGUFFile):
        if "tokenizer.ggml.tokens" not in src.metadata:
            return None
        from backend.text.tokenizer import Tokenizer

        return Tokenizer.from_gguf_metadata(src.metadata, path)
    if not (path / "tokenizer.json").exists():
        return None
    from backend.text.tokenizer import Tokenizer

    return Tokenizer.from_hf_folder(path)
