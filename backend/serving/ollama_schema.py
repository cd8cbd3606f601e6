"""Ollama's wire format: request bodies and their translation into OpenAI chat requests
(``options``, ``format``, messages with tool calls as objects), and how a model is
described in Ollama's listings. Plain data, no server: ``ollama_api`` does the I/O."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from backend.models.common import expected_shapes
from backend.models.config import ModelConfig
from backend.serving.api_errors import ApiError, validation_error
from backend.serving.openai_schema import ChatCompletionRequest

# The version of Ollama's API whose endpoints and fields this implements; clients gate
# features on it.
OLLAMA_API_VERSION = "0.12.0"
# Ollama's context when a request sets no num_ctx (and the model's is larger): each
# request's KV is booked for it, as Ollama allocates it per request slot.
DEFAULT_NUM_CTX = 4096

# Options that choose hardware, threads or memory: Ollama applies them when it loads a
# model; here the engine is configured when it starts, so they are accepted and left.
_LOAD_OPTIONS = frozenset(
    {
        "numa",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "f16_kv",
        "logits_all",
        "vocab_only",
        "use_mmap",
        "use_mlock",
        "embedding_only",
        "num_thread",
        "num_keep",
        "penalize_newline",
        "repeat_last_n",
        "mirostat_tau",
        "mirostat_eta",
    }
)
# Sampling options this engine does not implement, with the value that means "off".
_OFF_VALUES = {
    "mirostat": 0,
    "typical_p": 1.0,
    "tfs_z": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "seed": "seed",
    "stop": "stop",
}


class OllamaRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | int | str | None = None
    think: bool | str | None = None

    def openai_fields(self, unlimited: int) -> tuple[dict[str, Any], int]:
        """Sampling and output fields as an OpenAI chat request takes them, and the
        context the request runs in (``num_ctx``, else Ollama's default, at most the
        model's). ``unlimited``: the model's context, the reply's token limit when
        ``num_predict`` sets none (it then ends where the context does)."""
        if self.think:
            raise ApiError(400, f'"{self.model}" does not support thinking', param="think")
        opts = dict(self.options or {})
        fields: dict[str, Any] = {"model": self.model}
        for name, off in _OFF_VALUES.items():
            if name in opts and opts.pop(name) not in (None, off):
                raise ApiError(400, f"option {name} is not supported", param=f"options.{name}")
        for name in _LOAD_OPTIONS:
            opts.pop(name, None)
        for name, field in _SAMPLING.items():
            if opts.get(name) is not None:
                fields[field] = opts[name]
            opts.pop(name, None)
        predict = opts.pop("num_predict", None)
        if predict is not None and (type(predict) is not int or predict == 0):
            raise ApiError(400, "options.num_predict must be a non-zero integer", param="options")
        # As Ollama: none, -1 or -2: until the reply ends or the context is full.
        fields["max_tokens"] = predict if predict is not None and predict > 0 else unlimited
        num_ctx = opts.pop("num_ctx", None)
        if num_ctx is not None and (type(num_ctx) is not int or num_ctx < 2):
            raise ApiError(400, "options.num_ctx must be an integer >= 2", param="options")
        num_ctx = min(num_ctx or DEFAULT_NUM_CTX, unlimited)
        if opts.pop("ignore_eos", None):  # extension, as on the other routes (benchmarks)
            fields["ignore_eos"] = True
        # Ollama ignores unknown options (it logs them); so do we.
        fmt = self.format
        if fmt == "json":
            fields["response_format"] = {"type": "json_object"}
        elif isinstance(fmt, dict):
            fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt}}
        elif fmt not in (None, ""):
            raise ApiError(400, 'format must be "json" or a JSON schema object', param="format")
        return fields, num_ctx


class ChatRequest(OllamaRequest):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    # Extension: Ollama's API has no tool_choice; OpenAI's ("auto", "none", "required"
    # or a named function) is taken here, to force a call.
    tool_choice: str | dict[str, Any] | None = None

    def openai(self, unlimited: int) -> tuple[ChatCompletionRequest, int]:
        fields, num_ctx = self.openai_fields(unlimited)
        messages = [openai_message(i, m) for i, m in enumerate(self.messages)]
        fields.update(messages=messages, tools=self.tools or None, stream=False)
        if self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        return validated(fields), num_ctx


class GenerateRequest(OllamaRequest):
    prompt: str | None = None
    system: str | None = None
    raw: bool = False
    context: list[int] | None = None
    suffix: str | None = None
    template: str | None = None
    images: list[Any] | None = None


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    name: str | None = None


def validated(fields: dict) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def openai_message(i: int, m: Any) -> dict:
    """An Ollama chat message as an OpenAI one (tool calls with object arguments)."""
    if not isinstance(m, dict):
        raise ApiError(400, f"messages[{i}] must be an object", param=f"messages.{i}")
    if m.get("images"):
        raise ApiError(
            400,
            f"messages[{i}] has images; this model reads text only",
            param=f"messages.{i}.images",
        )
    out: dict[str, Any] = {"role": m.get("role"), "content": m.get("content") or ""}
    if m.get("role") == "tool" and m.get("tool_name"):
        out["name"] = m["tool_name"]
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise ApiError(400, f"messages[{i}].tool_calls must be a list", param="messages")
        out["tool_calls"] = [
            {
                "id": (c.get("id") if isinstance(c, dict) else None) or f"call_{i}_{j}",
                "type": "function",
                "function": c.get("function") if isinstance(c, dict) else None,
            }
            for j, c in enumerate(calls)
        ]
    return out


def parameter_count(c: ModelConfig) -> int:
    """The model's weights, counted from the shapes its config implies: every resident
    tensor (``expected_shapes``: embeddings, attention or linear attention, norms,
    routers, shared experts) and every routed expert."""
    dense = sum(math.prod(shape) for shape in expected_shapes(c).values())
    return dense + c.n_routed_experts * 3 * c.hidden_size * c.expert_intermediate_size


def size_label(n: int) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            value = n / scale
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return str(n)
