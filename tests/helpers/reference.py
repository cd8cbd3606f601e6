"""The plain sequential forward every engine path is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.models.loader import LoadedModel
from backend.models.transformer import KVCache, SeqSlice
from tests.helpers.qblocks import rounded_8bit


def greedy_logits(
    model: LoadedModel, prompt: list[int], steps: int, get_expert=None, rounded: bool = False
) -> tuple[list[int], torch.Tensor]:
    """Prefill then ``steps`` greedy decode steps; logits at every predicting position.
    ``rounded``: each routed expert's input and inner activation rounded to 8 bits per
    block of 32 (``rounded_8bit``), as the native backend's packed Q4 kernels read them
    where every expert has a slot (SiLU experts without biases, as the tiny Q4 models')."""
    t = model.transformer
    get_expert = get_expert or model.resident_experts().get
    if rounded:
        assert t.config.plain_experts

        def mlp(weights, x, layer=-1, e=-1):
            gate, up, down = weights
            xr = rounded_8bit(x)
            return F.linear(rounded_8bit(F.silu(F.linear(xr, gate)) * F.linear(xr, up)), down)

        t.expert_mlp = mlp  # this model's routed experts, until the finally below
    try:
        kv = KVCache(model.config.n_layers)
        ids = list(prompt)
        out = [t.forward(torch.tensor(ids), [SeqSlice(kv, 0, len(ids))], get_expert)[0]]
        for _ in range(steps):
            ids.append(int(out[-1].argmax()))
            out.append(
                t.forward(torch.tensor(ids[-1:]), [SeqSlice(kv, len(ids) - 1, 1)], get_expert)[0]
            )
    finally:
        if rounded:
            del t.expert_mlp
    return ids, torch.stack(out)


def transformers_model(folder, weights_from=None, place=None):
    """transformers' model of HF ``folder`` (fp32, eval); with ``weights_from`` (a GGUF),
    each of its quantized tensors dequantized by the ``gguf`` package (the oracle) and
    given to ``place(state_dict, "model.layers.N.", base name, tensor)``, which copies it
    where transformers keeps it (and raises for a name it does not map)."""
    import gguf
    import numpy as np
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    if weights_from is None:
        return model
    sd = model.state_dict()
    replaced = 0
    for x in gguf.GGUFReader(weights_from).tensors:
        if x.tensor_type == gguf.GGMLQuantizationType.F32:
            continue
        t = torch.from_numpy(np.array(gguf.quants.dequantize(x.data, x.tensor_type), np.float32))
        _, layer, base, _ = x.name.split(".")
        place(sd, f"model.layers.{layer}.", base, t)
        replaced += 1
    assert replaced > 20
    return model


def transformers_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of ``ids``."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def copy_gate_or_up(fused: torch.Tensor, base: str, t: torch.Tensor) -> None:
    """GGUF ``ffn_gate_exps`` or ``ffn_up_exps`` [E, I, D] into transformers' fused
    gate_up [E, 2I, D] (gate's rows first)."""
    I = t.shape[1]
    (fused[:, :I] if base == "ffn_gate_exps" else fused[:, I:]).copy_(t)
