"""Ollama's API on the same server: ``/api/chat``, ``/api/generate``, ``/api/tags``,
``/api/show``, ``/api/ps`` and ``/api/version``, for the clients that speak it (Open
WebUI, Continue, Zed, Raycast, editor plugins, the ``ollama`` libraries).

A chat is translated into an OpenAI request and runs through the routes' shared path
(one queue, the same limits and checks); only the wire format is Ollama's: NDJSON lines
(streaming is the default), ``options`` for sampling, ``format`` for JSON output, tool
calls with their arguments as objects, durations in nanoseconds, errors as
``{"error": message}``. The server runs one model, listed as ``<name>:latest``; loading,
pulling and deleting models are not part of this API here.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from backend.config import SamplingParams
from backend.messages import Finished
from backend.serving.api_errors import ApiError
from backend.serving.calls import Call, CallDone, Done, Text, chat_parts, parse_body
from backend.serving.ollama_schema import (
    OLLAMA_API_VERSION,
    ChatRequest,
    GenerateRequest,
    OllamaRequest,
    ShowRequest,
    parameter_count,
    size_label,
    validated,
)
from backend.text.tool_calls import ToolCall, parse

if TYPE_CHECKING:
    from backend.serving.routes import ApiServer


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _tool_call(index: int, call: ToolCall) -> dict:
    return {
        "id": call.id,
        "function": {"index": index, "name": call.name, "arguments": json.loads(call.arguments)},
    }


def _timings(call: Call, fin_prompt: int, fin_completion: int) -> dict:
    """Ollama's counts and durations (nanoseconds) of a finished call."""
    now = time.perf_counter()
    first = call.t_first or now
    return {
        "total_duration": int((now - call.t_start) * 1e9),
        "load_duration": 0,
        "prompt_eval_count": fin_prompt,
        "prompt_eval_duration": int((first - call.t_start) * 1e9),
        "eval_count": fin_completion,
        "eval_duration": int((now - first) * 1e9),
    }


class _Listing:
    """How this server's model appears in Ollama's listings."""

    def __init__(self, api: ApiServer) -> None:
        model = api.service.model
        self.name = api.service.model_name
        if ":" not in self.name:
            self.name += ":latest"
        path = model.path
        stat = path.stat()
        self.modified_at = datetime.fromtimestamp(stat.st_mtime, UTC).isoformat()
        # An identity for the file (path, size, time), not a hash of its contents:
        # hashing gigabytes of weights would take the server minutes.
        ident = f"{path.resolve()}:{model.size_bytes}:{stat.st_mtime_ns}"
        self.digest = hashlib.sha256(ident.encode()).hexdigest()
        c = model.config
        self.details = {
            "parent_model": "",
            "format": "gguf" if path.suffix == ".gguf" else "safetensors",
            "family": c.family,
            "families": [c.family],
            "parameter_size": size_label(parameter_count(c)),
            "quantization_level": model.quant,
        }
        self.size = model.size_bytes

    def entry(self) -> dict:
        return {
            "name": self.name,
            "model": self.name,
            "modified_at": self.modified_at,
            "size": self.size,
            "digest": self.digest,
            "details": self.details,
        }


def add_routes(app: FastAPI, api: ApiServer) -> None:
    """Ollama's endpoints on ``app``, served by ``api``'s engine."""
    listing: list[_Listing] = []

    def model_listing() -> _Listing:
        if not listing:
            listing.append(_Listing(api))
        return listing[0]

    @app.get("/api/version")
    async def version() -> dict:
        from backend.serving.cli import version as bevy_version

        return {"version": OLLAMA_API_VERSION, "bevy": bevy_version()}

    @app.get("/api/tags")
    async def tags() -> dict:
        return {"models": [model_listing().entry()]}

    @app.get("/api/ps")
    async def ps() -> dict:
        s = api.service.latest
        held = (
            s.dense_bytes + s.slots_bytes + s.working_set_bytes + s.kv_bytes
            if s is not None
            else api.service.model.size_bytes
        )
        cuda = api.service.model.transformer.device.type == "cuda"
        entry = model_listing().entry()
        del entry["modified_at"]
        return {
            "models": [
                {
                    **entry,
                    "size": held,
                    "size_vram": held if cuda else 0,
                    "expires_at": "9999-12-31T23:59:59Z",  # loaded while the server runs
                    "context_length": api.service.model.config.context_length,
                }
            ]
        }

    @app.post("/api/show")
    async def show(request: Request) -> dict:
        body = await parse_body(request, ShowRequest)
        name = body.model or body.name  # "name": older clients
        if not name:
            raise ApiError(400, "model is required", param="model")
        api._check_model(name)
        m, info = api.service.model, model_listing()
        c, arch = m.config, m.config.family
        return {
            "modelfile": "",
            "parameters": "",
            "template": m.tokenizer.chat_template or "",
            "details": info.details,
            "model_info": {
                "general.architecture": arch,
                "general.parameter_count": parameter_count(c),
                f"{arch}.context_length": c.context_length,
                f"{arch}.embedding_length": c.hidden_size,
                f"{arch}.block_count": c.n_layers,
                f"{arch}.attention.head_count": c.n_heads,
                f"{arch}.attention.head_count_kv": c.n_kv_heads,
                f"{arch}.expert_count": c.n_experts,
                f"{arch}.expert_used_count": c.top_k,
            },
            "capabilities": ["completion", "tools"],
            "modified_at": info.modified_at,
        }

    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        body = await parse_body(request, ChatRequest)
        api._check_model(body.model)
        ctx = api.service.model.config.context_length
        if not body.messages:  # Ollama's way to load (or, with keep_alive 0, unload)
            fields, _ = body.openai_fields(ctx)  # its options are checked all the same
            validated({**fields, "messages": [{"role": "user", "content": ""}]})
            return _loaded(body, {"message": {"role": "assistant", "content": ""}})
        chat_body, num_ctx = body.openai(ctx)
        # Ollama keeps the system prompt and the latest turns of a chat too long for
        # the context.
        call, reader = await api.start_chat(chat_body, "ollama", "ollama", num_ctx, "rolling")
        name = body.model
        if body.stream:
            return _stream(api, call, _chat_lines(api, call, name, reader))
        fin = await api.collect(call, request)
        content, calls = parse(fin.text, reader) if reader else (fin.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [_tool_call(i, c) for i, c in enumerate(calls)]
        return JSONResponse(
            {
                "model": name,
                "created_at": _now(),
                "message": message,
                "done": True,
                "done_reason": fin.reason,
                **_timings(call, fin.prompt_tokens, fin.completion_tokens),
            }
        )

    @app.post("/api/generate")
    async def generate(request: Request) -> Response:
        body = await parse_body(request, GenerateRequest)
        api._check_model(body.model)
        for name in ("suffix", "template"):
            if getattr(body, name):
                raise ApiError(400, f"{name} is not supported", param=name)
        if body.images:
            raise ApiError(400, "images are given; this model reads text only", param="images")
        if not body.prompt and not body.context:
            return _loaded(body, {"response": ""})
        ctx = api.service.model.config.context_length
        fields, num_ctx = body.openai_fields(ctx)
        context = list(body.context or ())
        vocab = api.service.model.config.vocab_size
        if any(type(i) is not int or not 0 <= i < vocab for i in context):
            raise ApiError(400, f"context token ids must be in [0, {vocab})", param="context")
        if body.raw:  # the prompt as it is, no chat template
            check = validated({**fields, "messages": [{"role": "user", "content": ""}]})
            check.check_supported()
            params = check.sampling(check.max_tokens, check.grammar())
            limit = num_ctx
            tok = api.service.model.tokenizer

            def ids() -> list[int]:
                new = tok.encode(body.prompt or "", add_special=not context)
                prompt = api._check_prompt([*context, *new], "prompt")
                if len(prompt) >= limit:
                    raise ApiError(
                        400,
                        f"the prompt has {len(prompt)} tokens; the context (num_ctx) is "
                        f"{limit} tokens",
                        param="prompt",
                    )
                return prompt

            def fit(n_prompt: int) -> SamplingParams:
                return replace(params, max_tokens=max(1, min(params.max_tokens, limit - n_prompt)))

            call = await api.start("ollama", fit, ids, "ollama")
        else:
            messages = [{"role": "system", "content": body.system}] if body.system else []
            messages.append({"role": "user", "content": body.prompt or ""})
            chat_body = validated({**fields, "messages": messages})
            call, _ = await api.start_chat(chat_body, "ollama", "ollama", num_ctx, head_ids=context)
        if body.stream:
            return _stream(api, call, _generate_lines(api, call, body.model))
        fin = await api.collect(call, request)
        return JSONResponse(_generate_done(call, body.model, fin, fin.text))


def _loaded(body: OllamaRequest, reply: dict) -> Response:
    unload = body.keep_alive in (0, "0", "0s", "0m")
    return JSONResponse(
        {
            "model": body.model,
            "created_at": _now(),
            **reply,
            "done": True,
            "done_reason": "unload" if unload else "load",
        }
    )


def _line(data: dict) -> bytes:
    return (json.dumps(data, ensure_ascii=False) + "\n").encode()


def _stream(api: ApiServer, call: Call, lines: AsyncIterator[dict]) -> Response:
    async def frames() -> AsyncIterator[bytes]:
        async for line in lines:
            yield _line(line)

    return api.stream(
        call, frames(), lambda exc: _line({"error": exc.message}), "application/x-ndjson"
    )


async def _chat_lines(
    api: ApiServer, call: Call, name: str, tool_format: str | None
) -> AsyncIterator[dict]:
    async for part in chat_parts(call, tool_format):
        if isinstance(part, Text):
            message = {"role": "assistant", "content": part.text}
        elif isinstance(part, CallDone):  # Ollama sends each call whole, as it closes
            message = {
                "role": "assistant",
                "content": "",
                "tool_calls": [_tool_call(part.index, part.call)],
            }
        elif isinstance(part, Done):
            fin = part.fin
            api.count(fin)
            yield {
                "model": name,
                "created_at": _now(),
                "message": {"role": "assistant", "content": ""},
                "done": True,
                "done_reason": fin.reason,
                **_timings(call, fin.prompt_tokens, fin.completion_tokens),
            }
            return
        else:
            continue
        yield {"model": name, "created_at": _now(), "message": message, "done": False}


def _generate_done(call: Call, name: str, fin: Finished, text: str) -> dict:
    return {
        "model": name,
        "created_at": _now(),
        "response": text,
        "done": True,
        "done_reason": fin.reason,
        # The conversation so far as tokens, for the next request's ``context``.
        "context": [*call.prompt_ids, *fin.token_ids],
        **_timings(call, fin.prompt_tokens, fin.completion_tokens),
    }


async def _generate_lines(api: ApiServer, call: Call, name: str) -> AsyncIterator[dict]:
    async for part in chat_parts(call, None):
        if isinstance(part, Text):
            yield {"model": name, "created_at": _now(), "response": part.text, "done": False}
        elif isinstance(part, Done):
            api.count(part.fin)
            yield _generate_done(call, name, part.fin, "")
