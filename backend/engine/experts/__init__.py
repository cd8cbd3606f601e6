"""Expert-compute backends, one chosen when the engine starts (``select``).

- ``native``: hand-written CPU kernels on stored bytes (``native.EXPERT_TYPES``);
- ``compiled``: Inductor graphs on the same bytes, where the kernels do not build;
- ``grouped``: a job's experts decoded and multiplied together (accelerators);
- ``eager``: dequantize, then torch's matmuls: every device and block type.

``choose`` picks one from what the slots will be (their dtype and device), so a backend
that cannot run stops the engine before any slot is allocated; ``build`` makes it over
them. ``auto`` takes the first that can run: grouped for stored slots on an accelerator, else
native, compiled, eager on the CPU. The choice is made once from the device, the slot
format, the experts' block types and what builds, so no call tries one path after
another; a backend asked for by name that cannot run here is an error saying why.
Each backend is checked against plain generation (the exactness tests run each one that
can run here): native and compiled give the eager products' bits, grouped rounds as the
device's batched matmul does.
"""

from __future__ import annotations

import logging

import torch

from backend.engine.cache import ExpertCache
from backend.engine.experts.compiled import CompiledExperts
from backend.engine.experts.eager import EagerExperts
from backend.engine.experts.grouped import GroupedExperts
from backend.engine.experts.native import NativeExperts
from backend.errors import BevyError
from backend.kernels import native, qmatmul
from backend.models.transformer import Transformer
from backend.models.weights import ExpertRef
from backend.policies import EXPERT_BACKENDS

log = logging.getLogger(__name__)

_CLASSES: dict[str, type[EagerExperts]] = {
    "native": NativeExperts,
    "compiled": CompiledExperts,
    "grouped": GroupedExperts,
    "eager": EagerExperts,
}


def _kinds(experts: list[list[ExpertRef]]) -> set[tuple]:
    """Each distinct expert as (block type, shape, bytes) of its gate, up and down."""
    return {
        tuple((p.qtype, tuple(p.shape), p.nbytes) for p in ref.parts)
        for layer in experts
        for ref in layer
    }


def why_not(
    name: str,
    experts: list[list[ExpertRef]],
    slots: torch.Tensor,
    dtype: torch.dtype,
    use_native: bool = True,
    use_compile: bool = True,
    plain: bool = True,
    act: str | None = "silu",
) -> str | None:
    """Why backend ``name`` cannot run these experts in these slots; None if it can.
    ``plain``: the experts are SiLU-gated MLPs without biases (``ModelConfig.plain_experts``);
    ``act``: their activation where the native kernels compute them
    (``ModelConfig.native_act``), else None."""
    if name == "eager":
        return None
    if act is None or (not plain and act != "gelu"):
        return "the experts have biases and a clamped SwiGLU (gpt-oss): only eager computes them"
    if not plain and name != "native":
        return (
            "the experts are GELU-gated (Gemma 4): only the native and eager backends compute them"
        )
    if slots.dtype != torch.uint8:
        return "the cache slots hold decoded weights (slot_format 'decoded'): only eager uses them"
    kinds = _kinds(experts)
    if name == "grouped":
        if any(len(_kinds([layer])) > 1 for layer in experts):
            return "a layer's experts differ in block type or shape"
        return None
    if slots.device.type != "cpu":
        return f"it runs on the CPU, and the experts are on {slots.device.type}"
    if dtype != torch.float32:
        return f"it computes in float32, and the model runs in {dtype}"
    if name == "native":
        if not use_native:
            return "the native kernels are turned off (native=False, or BEVY_NATIVE=0)"
        if not native.available():
            return "the native kernels did not build on this machine (see the log)"
        refused = sorted({str(k[0][0].name) for k in kinds if native.mlp_types(k, act) is None})
        if refused:
            takes = "/".join(q.name for q in native.EXPERT_TYPES)
            return f"the native kernels take {takes} experts, not {', '.join(refused)}"
        for layer in experts:
            if layer and len({tuple(r.gate.shape) for r in layer}) > 1:
                return "a layer's experts differ in shape"
        return None
    if name == "compiled":
        if not use_compile:
            return "compiled graphs are turned off (compile=False, or BEVY_COMPILE=0)"
        if len(kinds) > qmatmul.MAX_KINDS:
            return f"the model has {len(kinds)} expert kinds; graphs are built for at most {qmatmul.MAX_KINDS}"
        for kind in sorted(kinds, key=str):
            parts = tuple((torch.zeros(n, dtype=torch.uint8), q, shape) for q, shape, n in kind)
            if not qmatmul.warm_up(parts):
                return "the expert graphs cannot be compiled for these experts (see the log)"
        return None
    raise ValueError(f"unknown expert backend {name!r} (known: {', '.join(EXPERT_BACKENDS)})")


def choose(
    requested: str,
    experts: list[list[ExpertRef]],
    slot_dtype: torch.dtype,
    device: torch.device,
    dtype: torch.dtype,
    use_native: bool = True,
    use_compile: bool = True,
    plain: bool = True,
    act: str | None = "silu",
) -> str:
    """The backend ``requested`` ("auto" or a name) for slots of ``slot_dtype`` on
    ``device``, chosen before the slots are allocated; BevyError if a named one cannot
    run here."""
    probe = torch.empty(0, dtype=slot_dtype, device=device)
    args = (experts, probe, dtype, use_native, use_compile, plain, act)
    if requested == "auto":
        order = ("grouped", "eager") if device.type != "cpu" else ("native", "compiled")
        name = next((n for n in order if why_not(n, *args) is None), "eager")
    else:
        reason = why_not(requested, *args)
        if reason is not None:
            raise BevyError(f"expert backend {requested!r} cannot run here: {reason}")
        name = requested
    log.info("expert backend: %s (%s)", name, "chosen" if requested == "auto" else "requested")
    return name


def build(
    name: str,
    t: Transformer,
    experts: list[list[ExpertRef]],
    cache: ExpertCache,
    slots: torch.Tensor,
    layouts: dict,
    working_set: int = 0,
) -> EagerExperts:
    """Backend ``name`` (from ``choose``) over these slots, ready to run."""
    return _CLASSES[name](t, experts, cache, slots, layouts, working_set)
