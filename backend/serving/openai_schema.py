"""The OpenAI wire format: request bodies, their translation to engine terms, response bodies.

Plain functions over plain data, no server and no engine: ``backend.serving.routes`` does the I/O.
Requests accept unknown fields (clients send ``user``, ``metadata`` ...) and refuse, with a
400, the known ones we cannot honour, rather than silently ignoring them.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from backend.config import Grammar, SamplingParams
from backend.messages import Finished
from backend.serving.api_errors import ApiError
from backend.text.tool_calls import (
    Syntax,
    ToolCall,
    call_grammar,
    lazy_call_grammar,
    tools_prompt,
)

# --- requests ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


ROLES = ("system", "developer", "user", "assistant", "tool")


class _GenerationRequest(BaseModel):
    # Strict: "10" is not a number and true is not 10 (OpenAI refuses both too).
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None  # None: the loaded model
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | int | None = None
    # Extensions under the names vLLM and llama.cpp's server use.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise ApiError(400, f"n must be 1 (one choice per request), got {self.n}", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported; use repetition_penalty", param=name)
        if self.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")

    def sampling(self, max_tokens: int | None, grammar: Grammar | None = None) -> SamplingParams:
        """Engine sampling settings; fields left unset take Bevy's defaults."""
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ApiError(400, "seed must fit in 64 bits", param="seed")
        # llama.cpp and its clients send -1 (any negative seed) for "random".
        seed = self.seed if self.seed is not None and self.seed >= 0 else None
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "max_tokens": max_tokens,
            "seed": seed,
        }
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            return SamplingParams(
                **{k: v for k, v in given.items() if v is not None},
                stop=stop,
                ignore_eos=self.ignore_eos,
                grammar=grammar,
            )
        except ValueError as exc:  # SamplingParams names the field first: "top_p must be ..."
            message = str(exc)
            param = message.split(" ", 1)[0]
            raise ApiError(
                400, message, param=param if param in (*given, "stop") else None
            ) from None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # Extension: a chat longer than the context leaves turns out instead of failing
    # ("rolling": the oldest after the system prompt; "truncate_middle": those after the
    # first turn). Default: OpenAI's error.
    context_overflow: Literal["error", "rolling", "truncate_middle"] | None = None
    # vLLM's names: go on with the last (assistant) message instead of opening a new turn.
    # Unset, a chat ending in an assistant message with text is continued, as llama.cpp's
    # server does and as Anthropic's and Ollama's APIs define (a prefilled reply).
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None

    def continues(self) -> bool:
        """Whether the reply goes on with the chat's last message (see the fields)."""
        if self.continue_final_message is not None or self.add_generation_prompt is not None:
            if self.continue_final_message and self.add_generation_prompt:
                raise ApiError(
                    400,
                    "continue_final_message and add_generation_prompt cannot both be true",
                    param="continue_final_message",
                )
            return bool(self.continue_final_message)
        last = self.messages[-1]
        content = last.get("content")
        return (
            last.get("role") == "assistant"
            and not last.get("tool_calls")
            and isinstance(content, str)
            and bool(content.strip())
        )

    def params(self, syntax: Syntax) -> SamplingParams:
        """Sampling settings; ``syntax``: how the model writes calls (``tool_syntax``)."""
        self.check_supported()
        self.check_tools()
        grammar = self.grammar()
        forced = self.forced_tools()
        if forced is not None:
            if grammar is not None:
                raise ApiError(
                    400,
                    "give response_format or a forced tool_choice, not both",
                    param="tool_choice",
                )
            grammar = Grammar("lark", call_grammar(forced, syntax))
        elif grammar is None and self.uses_tools and syntax.fmt in ("hermes", "mistral"):
            # "auto" where a call opens with a tag of its own: free text, but a call once
            # begun must be a valid one. (The generic format's fence also opens plain JSON,
            # and Llama 3 writes a call as a bare JSON object: those are read, not held.)
            parallel = self.parallel_tool_calls is not False
            grammar = Grammar("lark", lazy_call_grammar(self.tools, syntax, parallel))
        return self.sampling(
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens,
            grammar,
        )

    def check_tools(self) -> None:
        """``tools`` and ``tool_choice`` in OpenAI's shapes, or a 400 naming the bad one."""
        for i, t in enumerate(self.tools or ()):
            fn = t.get("function") if isinstance(t, dict) else None
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
                raise ApiError(
                    400,
                    f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                    '"parameters": {...}}}',
                    param=f"tools.{i}",
                )
            if not isinstance(fn.get("parameters", {}), dict):
                raise ApiError(
                    400,
                    f"tools[{i}].function.parameters must be a JSON schema object",
                    param=f"tools.{i}",
                )
        choice = self.tool_choice
        if isinstance(choice, dict) and not isinstance(choice.get("function"), dict):
            raise ApiError(
                400,
                'tool_choice must be {"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )

    @property
    def uses_tools(self) -> bool:
        """Whether the reply is read for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tools(self) -> list[dict] | None:
        """The tools a call is forced among ("required": any; a named one: it), else None."""
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return None
        if not self.tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        if choice == "required":
            return self.tools
        if isinstance(choice, dict) and choice.get("type") == "function":
            name = (choice.get("function") or {}).get("name")
            named = [t for t in self.tools if (t.get("function") or {}).get("name") == name]
            if not named:
                raise ApiError(
                    400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
                )
            return named
        raise ApiError(
            400,
            "tool_choice must be 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )

    def grammar(self) -> Grammar | None:
        """``response_format`` as a grammar: "json_object" (any JSON object) or
        "json_schema" (that schema; every reply is held to it, "strict" or not)."""
        rf = self.response_format or {}
        kind = rf.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return Grammar("json_schema", json.dumps({"type": "object"}))
        if kind == "json_schema":
            schema = (rf.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ApiError(
                    400,
                    "response_format.json_schema.schema must be a JSON schema object",
                    param="response_format",
                )
            return Grammar("json_schema", json.dumps(schema))
        raise ApiError(
            400,
            f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
            param="response_format",
        )

    def chat_tools(self, fmt: str) -> list[dict] | None:
        """Tools for the chat template: a template with tool syntax renders them itself;
        for others (``generic``) they are described in the system prompt instead."""
        return self.tools if self.uses_tools and fmt != "generic" else None

    def chat_messages(self, fmt: str) -> list[dict]:
        """Messages as chat templates expect them: text parts joined into strings, no
        missing content, tool-call arguments as objects; for the ``generic`` format,
        earlier calls written back as the model writes them and the tools described in
        the system prompt."""
        self.check_tools()
        out = [dict(m) for m in self._plain_messages()]
        for i, m in enumerate(out):
            if m.get("content") is None:
                m["content"] = ""
            if fmt == "generic" and m["role"] == "tool":
                # Templates without tool syntax know no "tool" role: the result comes back
                # as the user's turn, labelled.
                m = out[i] = {"role": "user", "content": f"Tool result: {m['content']}"}
            calls = m.get("tool_calls")
            if m["role"] != "assistant" or not calls:
                continue
            if not isinstance(calls, list):
                raise ApiError(
                    400, f"messages[{i}].tool_calls must be a list", param=f"messages.{i}"
                )
            parsed = []
            for j, c in enumerate(calls):
                if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
                    raise ApiError(
                        400,
                        f"messages[{i}].tool_calls[{j}] must be "
                        '{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}',
                        param=f"messages.{i}",
                    )
                fn = c["function"]
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    raise ApiError(
                        400,
                        f"tool_calls[{j}].function.arguments is not JSON",
                        param="messages",
                    ) from None
                parsed.append({**c, "function": {"name": fn.get("name", ""), "arguments": args}})
            m["tool_calls"] = parsed
            if fmt == "generic":
                written = (
                    ToolCall(c["function"]["name"], json.dumps(c["function"]["arguments"])).text()
                    for c in parsed
                )
                m["content"] = "\n".join([m["content"], *written]).lstrip("\n")
                del m["tool_calls"]
        if fmt == "generic" and self.uses_tools:
            prompt = tools_prompt(self.tools)
            if out and out[0]["role"] == "system":
                out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out

    def _plain_messages(self) -> list[dict]:
        """Messages with text content parts joined into strings (copies)."""
        out = []
        for i, m in enumerate(self.messages):
            if not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] has no role", param=f"messages.{i}.role")
            if m["role"] not in ROLES:
                raise ApiError(
                    400,
                    f"messages[{i}].role {m['role']!r} is not one of {', '.join(ROLES)}",
                    param=f"messages.{i}.role",
                )
            if m["role"] == "developer":  # OpenAI's newer name for the system prompt
                m = {**m, "role": "system"}
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if not (isinstance(part, dict) and part.get("type") == "text"):
                        raise ApiError(
                            400,
                            f"messages[{i}]: only text content parts are supported",
                            param=f"messages.{i}.content",
                        )
                    parts.append(str(part.get("text", "")))
                m = {**m, "content": "".join(parts)}
            elif content is not None and not isinstance(content, str):
                raise ApiError(
                    400, f"messages[{i}].content must be a string", param=f"messages.{i}.content"
                )
            out.append(m)
        return out


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # llama.cpp's server extensions: a JSON schema, or a GBNF grammar (Lark where it
    # starts with "%llguidance", as llama.cpp reads it).
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None

    def params(self) -> SamplingParams:
        self.check_supported()
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise ApiError(400, "best_of must be 1", param="best_of")
        if self.json_schema is not None and self.grammar:
            raise ApiError(400, "give json_schema or grammar, not both", param="grammar")
        grammar = None
        if self.json_schema is not None:
            grammar = Grammar("json_schema", json.dumps(self.json_schema))
        elif self.grammar:
            kind = "lark" if self.grammar.lstrip().startswith("%llguidance") else "gbnf"
            grammar = Grammar(kind, self.grammar)
        return self.sampling(self.max_tokens, grammar)

    def prompt_text_or_ids(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise ApiError(400, "give one prompt per request", param="prompt")
            return p[0]
        return p


# --- responses --------------------------------------------------------------------------


def usage(fin: Finished) -> dict:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
    }


def chat_completion(
    rid: str, model: str, text: str, fin: Finished, calls: list[ToolCall] = ()
) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message = {
            "role": "assistant",
            "content": text or None,
            "tool_calls": [c.openai() for c in calls],
        }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": "tool_calls" if calls else fin.reason,
            }
        ],
        "usage": usage(fin),
        "system_fingerprint": None,
    }


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    delta: dict | None,
    finish: str | None = None,
    usage_: dict | None = None,
    with_usage: bool = False,
) -> dict:
    """One streamed chunk; ``delta=None`` is the usage-only chunk (empty choices)."""
    chunk = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if with_usage:  # as OpenAI: every chunk carries "usage", null until the last one
        chunk["usage"] = usage_
    return chunk


def completion(
    rid: str,
    model: str,
    created: int,
    text: str,
    finish: str | None,
    usage_: dict | None = None,
    with_usage: bool = False,
    choices: bool = True,
) -> dict:
    """A text completion, or one chunk of a streamed one."""
    body = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
        if choices
        else [],
    }
    if usage_ is not None or with_usage:
        body["usage"] = usage_
    return body


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "bevy"}
