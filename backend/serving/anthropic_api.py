"""Anthropic's Messages API on the same server: ``POST /v1/messages`` and
``/v1/messages/count_tokens``, for Claude Code and other agents built on Anthropic's SDKs
(they take a base URL and a key).

A request is translated into an OpenAI chat request (``system`` as the system message,
``tool_use`` blocks as tool calls, ``tool_result`` blocks as tool messages, ``tools``
with their ``input_schema``) and runs through the routes' shared path: one queue, the
same limits, grammars for a forced ``tool_choice``. Replies come back as content blocks,
streamed with Anthropic's event sequence; errors in Anthropic's shape.

Extended ``thinking`` is accepted and not done (the reply has no thinking blocks, which
a budget allows); images and documents are refused, the model reads text only.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from backend.errors import BevyError
from backend.messages import Finished
from backend.models.generate import chat_prompt_ids
from backend.serving.api_errors import ApiError, validation_error
from backend.serving.calls import (
    Call,
    CallArgs,
    CallDone,
    CallDropped,
    CallOpen,
    Done,
    Text,
    chat_parts,
    parse_body,
)
from backend.serving.openai_schema import ChatCompletionRequest
from backend.text.tool_calls import ToolCall, parse, tool_syntax

if TYPE_CHECKING:
    from backend.serving.routes import ApiServer


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def openai(self, max_tokens: int = 1, **fields: Any) -> ChatCompletionRequest:
        """The request as an OpenAI chat request."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [*self._system(), *_messages(self.messages)],
            "max_tokens": max_tokens,
            **fields,
        }
        if self.tools:
            body["tools"] = [_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body.update(_tool_choice(self.tool_choice, bool(self.tools)))
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None

    def _system(self) -> list[dict]:
        if self.system is None:
            return []
        text = self.system if isinstance(self.system, str) else _text(self.system, "system")
        return [{"role": "system", "content": text}] if text else []


class MessagesRequest(CountTokensRequest):
    max_tokens: int  # required, as Anthropic's API has it
    stop_sequences: list[str] | None = None
    # Gone from Anthropic's current SDKs (they send them through ``extra_body``), still
    # sent by older ones and by hand-written clients.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    # ``format``: structured output under a JSON schema; ``effort`` is accepted and
    # has no meaning for a model that does not think.
    output_config: dict[str, Any] | None = None

    def chat(self) -> ChatCompletionRequest:
        if self.max_tokens < 1:
            raise ApiError(400, "max_tokens: must be at least 1", param="max_tokens")
        if self.temperature is not None and not 0.0 <= self.temperature <= 1.0:
            raise ApiError(400, "temperature: must be between 0 and 1", param="temperature")
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences or None,
            "response_format": self._response_format(),
            # Extension under vLLM's name, as on the OpenAI routes (benchmarks, tests).
            "ignore_eos": (self.model_extra or {}).get("ignore_eos"),
        }
        return self.openai(self.max_tokens, **{k: v for k, v in given.items() if v is not None})

    def _response_format(self) -> dict | None:
        fmt = (self.output_config or {}).get("format")
        if fmt is None:
            return None
        if not (
            isinstance(fmt, dict)
            and fmt.get("type") == "json_schema"
            and isinstance(fmt.get("schema"), dict)
        ):
            raise ApiError(
                400,
                'output_config.format: must be {"type": "json_schema", "schema": {...}}',
                param="output_config",
            )
        return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}


def _text(blocks: list, where: str) -> str:
    """Text blocks joined (a system prompt, a tool result)."""
    parts = []
    for j, b in enumerate(blocks):
        if not (isinstance(b, dict) and b.get("type") == "text"):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise ApiError(
                400, f"{where}[{j}]: only text blocks are supported here, got {kind!r}", param=where
            )
        parts.append(str(b.get("text", "")))
    return "\n\n".join(parts)


def _messages(messages: list[dict]) -> list[dict]:
    """Anthropic messages as OpenAI ones: a user turn's tool_result blocks become tool
    messages (before its text), an assistant turn's tool_use blocks its tool calls."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise ApiError(
                400, f"messages.{i}.role: must be 'user' or 'assistant'", param=f"messages.{i}"
            )
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(
                400, f"messages.{i}.content: must be a string or a list of blocks", param="messages"
            )
        texts, calls, results = [], [], []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            where = f"messages.{i}.content.{j}"
            if kind == "text":
                texts.append(str(b.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise ApiError(
                        400, f"{where}: tool_use needs a name and an input object", param=where
                    )
                calls.append(
                    {
                        "id": str(b.get("id") or f"toolu_{i}_{j}"),
                        "type": "function",
                        "function": {"name": b["name"], "arguments": b.get("input", {})},
                    }
                )
            elif kind == "tool_result" and role == "user":
                result = b.get("content", "")
                text = result if isinstance(result, str) else _text(result or [], where)
                if b.get("is_error"):
                    text = f"Error: {text}"
                results.append(
                    {"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")), "content": text}
                )
            elif kind in ("thinking", "redacted_thinking"):
                continue  # earlier thinking is not shown to a model that does not think
            else:
                raise ApiError(
                    400,
                    f"{where}: {kind!r} blocks are not supported in {role} messages "
                    "(this model reads text, tool_use and tool_result blocks)",
                    param=where,
                )
        out.extend(results)
        if role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
        elif texts or not results:
            out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _tool(i: int, t: Any) -> dict:
    if not (isinstance(t, dict) and isinstance(t.get("name"), str) and t["name"]):
        raise ApiError(400, f"tools.{i}: a tool needs a name", param=f"tools.{i}")
    if not isinstance(t.get("input_schema"), dict):
        kind = t.get("type")
        raise ApiError(
            400,
            f"tools.{i}: {kind!r} is one of Anthropic's own tools, which this server does not "
            "run; define it with a name and an input_schema"
            if kind not in (None, "custom")
            else f"tools.{i}.input_schema: a JSON schema object is required",
            param=f"tools.{i}",
        )
    fn = {"name": t["name"], "parameters": t["input_schema"]}
    if t.get("description"):
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict, have_tools: bool) -> dict:
    kind = choice.get("type")
    fields: dict[str, Any] = {}
    if choice.get("disable_parallel_tool_use"):
        fields["parallel_tool_calls"] = False
    if kind == "auto":
        return {**fields, "tool_choice": "auto"} if have_tools else fields
    if kind == "none":
        return {**fields, "tool_choice": "none"} if have_tools else fields
    if kind == "any":
        return {**fields, "tool_choice": "required"}
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {**fields, "tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    raise ApiError(
        400,
        "tool_choice: must be {type: auto}, {type: any}, {type: none} or {type: tool, name}",
        param="tool_choice",
    )


def stop_reason(fin: Finished, calls: int, max_tokens: int) -> str:
    if calls:
        return "tool_use"
    if fin.reason == "length":
        # Short of max_tokens, the reply ran into the end of the context.
        if fin.completion_tokens < max_tokens:
            return "model_context_window_exceeded"
        return "max_tokens"
    return "stop_sequence" if fin.stop_sequence is not None else "end_turn"


def _usage(call: Call, fin: Finished | None = None) -> dict:
    return {
        "input_tokens": fin.prompt_tokens if fin else len(call.prompt_ids),
        "output_tokens": fin.completion_tokens if fin else 0,
    }


def _tool_use(call: ToolCall) -> dict:
    return {
        "type": "tool_use",
        "id": call.id,
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def _event(data: dict) -> bytes:
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def add_routes(app: FastAPI, api: ApiServer) -> None:
    """Anthropic's endpoints on ``app``, served by ``api``'s engine."""

    def tool_format() -> str:
        tok = api.service.model.tokenizer
        return tool_syntax(tok.chat_template, tok.special_id).fmt

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body = await parse_body(request, MessagesRequest)
        api._check_model(body.model)
        call, reader = await api.start_chat(body.chat(), "msg", "anthropic")
        if body.stream:

            async def frames() -> AsyncIterator[bytes]:
                async for event in _events(api, call, body.model, reader, body.max_tokens):
                    yield _event(event)

            def error(exc: ApiError) -> bytes:
                return _event(exc.body_for("/v1/messages"))

            return api.stream(call, frames(), error, "text/event-stream")
        fin = await api.collect(call, request)
        text, calls = parse(fin.text, reader) if reader else (fin.text, [])
        content = [{"type": "text", "text": text}] if text or not calls else []
        content += [_tool_use(c) for c in calls]
        return JSONResponse(
            {
                "id": call.rid,
                "type": "message",
                "role": "assistant",
                "model": body.model,
                "content": content,
                "stop_reason": stop_reason(fin, len(calls), body.max_tokens),
                "stop_sequence": fin.stop_sequence,
                "usage": _usage(call, fin),
            }
        )

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        body = await parse_body(request, CountTokensRequest)
        api._check_model(body.model)
        chat = body.openai()
        fmt = tool_format()
        chat.check_supported()
        messages, tools = chat.chat_messages(fmt), chat.chat_tools(fmt)

        def count() -> int:
            try:
                return len(chat_prompt_ids(api.service.model, messages, tools))
            except (ValueError, BevyError) as exc:  # the chat template refused it
                raise ApiError(400, str(exc), param="messages") from None

        return {"input_tokens": await run_in_threadpool(count)}


async def _events(
    api: ApiServer, call: Call, model: str, tool_format: str | None, max_tokens: int
) -> AsyncIterator[dict]:
    """The reply as Anthropic's stream: message_start, a content block per text run and
    per tool call (start, deltas, stop), message_delta with the stop reason, message_stop."""
    message = {
        "id": call.rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(call),
    }
    yield {"type": "message_start", "message": message}
    yield {"type": "ping"}
    blocks = 0  # content blocks started
    open_kind: str | None = None  # the kind of the block open now: "text", "tool_use"

    def start(block: dict) -> list[dict]:
        nonlocal blocks, open_kind
        out = stop()
        out.append({"type": "content_block_start", "index": blocks, "content_block": block})
        blocks, open_kind = blocks + 1, block["type"]
        return out

    def stop() -> list[dict]:
        nonlocal open_kind
        if open_kind is None:
            return []
        open_kind = None
        return [{"type": "content_block_stop", "index": blocks - 1}]

    def args(fragment: str) -> dict:
        delta = {"type": "input_json_delta", "partial_json": fragment}
        return {"type": "content_block_delta", "index": blocks - 1, "delta": delta}

    async for part in chat_parts(call, tool_format):
        out: list[dict] = []
        if isinstance(part, Text):
            if open_kind != "text":
                out += start({"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": part.text}
            out.append({"type": "content_block_delta", "index": blocks - 1, "delta": delta})
        elif isinstance(part, CallOpen):
            out += start({"type": "tool_use", "id": part.id, "name": part.name, "input": {}})
        elif isinstance(part, CallArgs):
            out.append(args(part.fragment))
        elif isinstance(part, CallDone):
            if not part.streamed:
                c = part.call
                out += start({"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
                out.append(args(c.arguments))
            out += stop()
        elif isinstance(part, CallDropped):
            out += stop()
        elif isinstance(part, Done):
            fin = part.fin
            api.count(fin)
            if blocks == 0:  # an empty reply still has its (empty) text block
                out += start({"type": "text", "text": ""})
            out += stop()
            delta = {
                "stop_reason": stop_reason(fin, part.calls, max_tokens),
                "stop_sequence": fin.stop_sequence,
            }
            out.append({"type": "message_delta", "delta": delta, "usage": _usage(call, fin)})
            out.append({"type": "message_stop"})
        for event in out:
            yield event
