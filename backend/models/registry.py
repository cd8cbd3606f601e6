"""Families by architecture name; each family module is imported only when asked for."""

from __future__ import annotations

import importlib

from backend.models.common import Family

_MODULES = {
    "llama": "backend.models.llama",
    "mixtral": "backend.models.mixtral",
    "qwen3_moe": "backend.models.qwen3_moe",
    "olmoe": "backend.models.olmoe",
    "qwen2_moe": "backend.models.qwen2_moe",
    "gpt_oss": "backend.models.gpt_oss",
    "qwen3_5_moe": "backend.models.qwen3_5_moe",
    "gemma4": "backend.models.gemma4",
}
_HF = {
    "LlamaForCausalLM": "llama",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
}
_GGUF = {
    "qwen3moe": "qwen3_moe",
    "olmoe": "olmoe",
    "qwen2moe": "qwen2_moe",
    "gpt-oss": "gpt_oss",
    "qwen35moe": "qwen3_5_moe",
    "gemma4": "gemma4",
}

FAMILIES = tuple(_MODULES)
HF_ARCHITECTURES = tuple(_HF)
GGUF_ARCHITECTURES = ("llama", *_GGUF)


def family(name: str) -> Family:
    return importlib.import_module(_MODULES[name]).FAMILY


def hf_family(architecture: str) -> Family | None:
    name = _HF.get(architecture)
    return family(name) if name else None


def gguf_family(architecture: str, has_experts: bool) -> Family | None:
    if architecture == "llama":
        return family("mixtral" if has_experts else "llama")
    name = _GGUF.get(architecture)
    return family(name) if name else None
