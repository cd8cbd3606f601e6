"""One engine request as an API route sees it, and its reply as dialect-neutral parts.

Each HTTP request becomes one engine request (a ``Call``). The service calls its listener
on the dispatcher thread, so the listener only hands events to the server's event loop.
``chat_parts`` reads the reply as it streams into text and tool calls (opened, argument
fragments, closed) in the order they come; each API dialect (OpenAI chunks, Anthropic
content blocks, Ollama lines) renders those parts its own way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from backend.messages import ErrorEvent, Event, Finished, TokenEvent
from backend.serving.api_errors import ApiError, validation_error
from backend.serving.service import EngineService
from backend.text.tool_calls import StreamParser, ToolCall

_Body = TypeVar("_Body", bound=BaseModel)


class Call:
    """An engine request's events, arriving on an asyncio queue."""

    def __init__(
        self,
        service: EngineService,
        rid: str,
        loop: asyncio.AbstractEventLoop,
        dialect: str = "openai",
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.service, self.rid, self._loop = service, rid, loop
        self.dialect, self.prompt_ids = dialect, list(prompt_ids or ())
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.tokens = 0
        self.ended = False
        self.t_start = time.perf_counter()  # submitted
        self.t_first: float | None = None  # its first token arrived

    def listener(self, ev: Event) -> None:  # on the service's dispatcher thread
        # RuntimeError: the server's loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, ev)

    async def events(self) -> AsyncIterator[TokenEvent | Finished]:
        """Token events, then the Finished; an engine error raises ApiError."""
        while True:
            ev = await self._queue.get()
            if isinstance(ev, ErrorEvent):
                self.ended = True
                # Before any token an error is the request's fault (the engine validates
                # it), unless the engine says it is its own (an expert read failed).
                ours = ev.server or self.service.failure is not None or self.tokens > 0
                if ours:
                    raise ApiError(500, ev.message, code="server_error")
                raise ApiError(400, ev.message)
            if isinstance(ev, Finished):
                self.ended = True
                if ev.reason == "abort":
                    raise ApiError(503, "the request was aborted on the server")
                yield ev
                return
            if self.t_first is None:
                self.t_first = time.perf_counter()
            self.tokens += 1
            yield ev


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallOpen:
    """A call written name first began: its id and name, before its arguments."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    """More of the open call's arguments (JSON text, a prefix of the final one)."""

    index: int
    fragment: str


@dataclass(frozen=True)
class CallDone:
    """A call closed. ``streamed``: it came as CallOpen and CallArgs, which already hold
    all of its arguments; else it comes whole here."""

    index: int
    call: ToolCall
    streamed: bool


@dataclass(frozen=True)
class CallDropped:
    """The open call closed as no call (malformed): what streamed cannot be taken back;
    its text comes as Text, and the next call takes the next index."""

    index: int


@dataclass(frozen=True)
class Done:
    fin: Finished
    opened: int  # call indexes used (dropped ones too)
    calls: int  # calls that closed


Part = Text | CallOpen | CallArgs | CallDone | CallDropped | Done


async def chat_parts(call: Call, tool_format: str | None) -> AsyncIterator[Part]:
    """The reply of ``call`` as parts; with ``tool_format`` (how the model writes calls),
    tool calls are read out of the text."""
    reader = StreamParser(tool_format) if tool_format else None
    index = closed = 0
    sent: tuple[str, str] | None = None  # the call streaming now: (id, arguments sent)

    def parts(text: str, calls: list[ToolCall]) -> list[Part]:
        nonlocal index, closed, sent
        assert reader is not None
        # A chunk's text comes before the calls it closes, unless a call was streaming
        # when it began: then that call ends first and the text is what followed it.
        after = sent is not None
        out: list[Part] = [Text(text)] if text and not after else []
        for c in calls:
            if sent is not None and sent[0] != c.id:
                out.append(CallDropped(index))
                index, sent = index + 1, None
            if sent is not None:  # finish what streamed
                if len(c.arguments) > len(sent[1]):
                    out.append(CallArgs(index, c.arguments[len(sent[1]) :]))
                out.append(CallDone(index, c, True))
            else:
                out.append(CallDone(index, c, False))
            index, closed, sent = index + 1, closed + 1, None
        part = reader.partial()
        if sent is not None and (part is None or part[0] != sent[0]):
            out.append(CallDropped(index))
            index, sent = index + 1, None
        if text and after:
            out.append(Text(text))
        if part is not None:
            cid, name, arguments = part
            if sent is None:
                out.append(CallOpen(index, cid, name))
                sent = (cid, "")
            if len(arguments) > len(sent[1]):
                out.append(CallArgs(index, arguments[len(sent[1]) :]))
                sent = (cid, arguments)
        return out

    async for ev in call.events():
        if isinstance(ev, TokenEvent):
            if reader is None:
                if ev.text:
                    yield Text(ev.text)
            else:
                for p in parts(*reader.feed(ev.text)):
                    yield p
            continue
        if reader is not None:
            for p in parts(*reader.finish()):
                yield p
        yield Done(ev, index, closed)


async def parse_body(request: Request, model: type[_Body]) -> _Body:
    """The JSON body as ``model``, whatever the Content-Type (curl -d sends a form type)."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "the body's JSON is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    if b"\\u" in raw:  # only an escape can spell a lone surrogate in UTF-8 JSON
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start : exc.end].encode("unicode_escape").decode()
            raise ApiError(
                400, f"the body holds {bad}, an unpaired surrogate: it is not valid Unicode text"
            ) from None
        except RecursionError:
            raise ApiError(400, "the body's JSON is nested too deeply") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
