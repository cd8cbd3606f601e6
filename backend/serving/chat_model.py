"""One chat turn with tools on the local engine, as the agent loop asks for it
(``backend.agent.loop.ChatModel``): the same rendering, grammars and call parsing as the
OpenAI endpoint, without HTTP in between."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from backend.agent.loop import Reply
from backend.errors import BevyError
from backend.messages import ErrorEvent, Finished, Submit, TokenEvent
from backend.models.generate import fit_chat, prompt_room
from backend.serving.api_errors import ApiError
from backend.serving.openai_schema import ChatCompletionRequest
from backend.serving.service import EngineService
from backend.text.tool_calls import StreamParser, parse, tool_syntax


class LocalChatModel:
    """Turns on ``service``'s engine, labelled ``session`` in its progress views;
    ``sampling``: OpenAI request fields (temperature, max_tokens, ...)."""

    def __init__(
        self, service: EngineService, session: str = "agent", sampling: dict[str, Any] | None = None
    ) -> None:
        self.service = service
        self.session = session
        self.sampling = {"temperature": 0.2, "max_tokens": 1024, **(sampling or {})}
        tok = service.model.tokenizer
        self.syntax = tool_syntax(tok.chat_template, tok.special_id)
        self.tool_format = self.syntax.fmt

    def complete(
        self,
        messages: list[dict],
        tools: list[dict],
        tool_choice: str,
        on_text: Callable[[str], None],
        stop: threading.Event,
    ) -> Reply:
        fmt = self.tool_format
        try:
            body = ChatCompletionRequest(
                messages=messages, tools=tools or None, tool_choice=tool_choice, **self.sampling
            )
            params = body.params(self.syntax)
            model = self.service.model
            ids, _ = fit_chat(
                model,
                body.chat_messages(fmt),
                body.chat_tools(fmt),
                prompt_room(model, params.max_tokens),
                body.context_overflow or "error",
            )
        except ApiError as exc:
            raise BevyError(exc.message) from None
        except ValueError as exc:  # the chat template refused the conversation
            raise BevyError(str(exc)) from None
        rid = self.service.new_id(self.session)
        events: queue.Queue = queue.Queue()
        self.service.submit(Submit(rid, params, prompt_ids=ids, session=self.session), events.put)
        reader = StreamParser(fmt) if body.uses_tools else None
        aborted = False
        while True:
            if stop.is_set() and not aborted:
                self.service.abort(rid)  # Finished(abort) follows
                aborted = True
            try:
                ev = events.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(ev, TokenEvent) and ev.text:
                shown = reader.feed(ev.text)[0] if reader else ev.text
                if shown:
                    on_text(shown)
            elif isinstance(ev, ErrorEvent):
                raise BevyError(ev.message)
            elif isinstance(ev, Finished):
                break
        if reader is not None:
            tail = reader.finish()[0]
            if tail:
                on_text(tail)
        content, calls = parse(ev.text, fmt) if body.uses_tools else (ev.text, [])
        reason = "tool_calls" if calls else ev.reason
        return Reply(content, [c.openai() for c in calls], reason)
