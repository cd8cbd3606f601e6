"""The OpenAI-compatible API as a FastAPI app over one EngineService: routes and requests.

Each HTTP request becomes one engine request. The service calls our listener on its
dispatcher thread, so the listener only hands events to the server's event loop
(``call_soon_threadsafe``); everything else runs on that loop. A client that goes away
mid-request aborts it, which releases its cache pins. Starting and stopping a server
around this app is ``backend.serving.http``'s job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from backend.config import SamplingParams
from backend.errors import BevyError, ContextTooLong
from backend.messages import ErrorEvent, Event, Finished, Submit, TokenEvent
from backend.models.generate import fit_chat, prompt_room
from backend.serving.guard import LOOPBACK_ORIGIN, Guard
from backend.serving.metrics_text import ApiCounters, render_metrics
from backend.serving.openai_schema import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_completion,
    completion,
    model_card,
    usage,
    validation_error,
)
from backend.serving.service import EngineService
from backend.text.tool_calls import StreamParser, parse, tool_syntax

_Body = TypeVar("_Body", bound=BaseModel)


class _Call:
    """One engine request as the event loop sees it: its events arrive on an asyncio queue."""

    def __init__(self, service: EngineService, rid: str, loop: asyncio.AbstractEventLoop) -> None:
        self.service, self.rid, self._loop = service, rid, loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.tokens = 0
        self.ended = False

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
            self.tokens += 1
            yield ev


async def _parse(request: Request, model: type[_Body]) -> _Body:
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


def _sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


class ApiServer:
    """The FastAPI app serving one EngineService; ``app`` is the ASGI application."""

    def __init__(
        self,
        service: EngineService,
        api_key: str | None = None,
        max_queue: int = 64,
        allowed_hosts: tuple[str, ...] = (),
        cors_origins: tuple[str, ...] = (),
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.service, self.api_key, self.max_queue = service, api_key or None, max_queue
        # Beyond loopback names and IP addresses (guard.py): Host names and browser
        # origins allowed to reach the API ("*": any).
        self.allowed_hosts, self.cors_origins = tuple(allowed_hosts), tuple(cors_origins)
        self.counters = ApiCounters()
        self.created = int(time.time())
        self._reserved = 0  # admitted, still rendering the prompt: not yet in service.active
        self._calls: dict[str, _Call] = {}
        self.app = self._build()

    # --- routes -------------------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI(title="Bevy", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(Guard, api=self)
        # Outside the guard: preflights (which carry no key) are answered here, for the
        # origins the guard lets through.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=[o for o in self.cors_origins if o != "*"],
            allow_origin_regex=".*" if "*" in self.cors_origins else LOOPBACK_ORIGIN,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
        name = self.service.model_name

        @app.exception_handler(ApiError)
        async def api_error(_: Request, exc: ApiError) -> Response:
            return JSONResponse(exc.body, exc.status)

        @app.exception_handler(HTTPException)
        async def http_error(_: Request, exc: HTTPException) -> Response:
            err = ApiError(exc.status_code, str(exc.detail))
            return JSONResponse(err.body, err.status)

        @app.exception_handler(Exception)
        async def crashed(_: Request, exc: Exception) -> Response:
            err = ApiError(500, f"internal error: {exc!r}")
            return JSONResponse(err.body, err.status)

        @app.get("/health")
        async def health() -> Response:
            failure = self.service.failure
            degraded = None if failure else self.service.degraded()
            status = "error" if failure else "degraded" if degraded else "ok"
            body = {"status": status, "model": name, "error": failure or degraded}
            return JSONResponse(body, 503 if failure else 200)

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [model_card(name, self.created)]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str) -> dict:
            self._check_model(model_id)
            return model_card(name, self.created)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            body = await _parse(request, ChatCompletionRequest)
            self._check_model(body.model)
            tok = self.service.model.tokenizer
            syntax = tool_syntax(tok.chat_template, tok.special_id)
            fmt = syntax.fmt
            params = body.params(syntax)
            messages, tools = body.chat_messages(fmt), body.chat_tools(fmt)
            overflow = body.context_overflow or "error"
            call = await self._start(
                "chatcmpl", params, lambda: self._chat_ids(messages, tools, overflow, params)
            )
            reader = fmt if body.uses_tools else None
            if body.stream:
                with_usage = bool(body.stream_options and body.stream_options.include_usage)
                return self._stream(call, self._chat_chunks(call, with_usage, reader))
            fin = await self._collect(call, request)
            content, calls = parse(fin.text, reader) if reader else (fin.text, [])
            return JSONResponse(chat_completion(call.rid, name, content, fin, calls))

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await _parse(request, CompletionRequest)
            self._check_model(body.model)
            params = body.params()
            prompt = body.prompt_text_or_ids()
            call = await self._start("cmpl", params, lambda: self._completion_ids(prompt))
            echo = ""
            if body.echo:
                tok = self.service.model.tokenizer
                echo = prompt if isinstance(prompt, str) else tok.decode(prompt)
            if body.stream:
                with_usage = bool(body.stream_options and body.stream_options.include_usage)
                return self._stream(call, self._completion_chunks(call, echo, with_usage))
            fin = await self._collect(call, request)
            text = echo + fin.text
            return JSONResponse(
                completion(call.rid, name, int(time.time()), text, fin.reason, usage(fin))
            )

        @app.get("/v1/stats")
        async def stats() -> dict:
            return self.stats()

        @app.get("/metrics")
        async def metrics() -> Response:
            return PlainTextResponse(
                self.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8"
            )

        return app

    # --- requests -----------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        # The one model this server runs answers to its id (the file's stem), its file
        # name and "default", in any case: clients often keep a fixed model name.
        names = {self.service.model_name, self.service.model.path.name, "default"}
        if model and model.casefold() not in {n.casefold() for n in names}:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this server runs {self.service.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _check_prompt(self, ids: list[int], param: str) -> list[int]:
        ctx = self.service.model.config.context_length
        if not ids:
            raise ApiError(400, "the prompt is empty", param=param)
        if len(ids) >= ctx:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens; the model's context is {ctx} tokens "
                "(prompt and reply must fit in it)",
                param=param,
                code="context_length_exceeded",
            )
        return ids

    def _chat_ids(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        overflow: str = "error",
        params: SamplingParams | None = None,
    ) -> list[int]:
        model = self.service.model
        room = prompt_room(model, params.max_tokens if params is not None else 0)
        try:
            ids, _ = fit_chat(model, messages, tools, room, overflow)
        except ContextTooLong as exc:  # refused before any tokenizing
            raise ApiError(
                400, str(exc), param="messages", code="context_length_exceeded"
            ) from None
        except (ValueError, BevyError) as exc:  # the chat template refused the conversation
            raise ApiError(400, str(exc), param="messages") from None
        return self._check_prompt(ids, "messages")

    def _completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._check_prompt(
                self.service.model.tokenizer.encode(prompt, add_special=True), "prompt"
            )
        vocab = self.service.model.config.vocab_size
        if any(not 0 <= i < vocab for i in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return self._check_prompt(list(prompt), "prompt")

    async def _start(
        self, prefix: str, params: SamplingParams, prompt_ids: Callable[[], list[int]]
    ) -> _Call:
        """Admit (429 when the queue is full), tokenize off the loop, submit."""
        if self.service.active + self._reserved >= self.max_queue:
            self.counters.rejected += 1
            raise ApiError(
                429,
                f"the server is busy: {self.max_queue} requests are in flight; retry later",
                code="rate_limit_exceeded",
            )
        self._reserved += 1
        try:
            ids = await run_in_threadpool(prompt_ids)
            rid = self.service.new_id(prefix)
            call = _Call(self.service, rid, asyncio.get_running_loop())
            self._calls[rid] = call
            self.service.submit(Submit(rid, params, prompt_ids=ids, session="api"), call.listener)
        finally:
            self._reserved -= 1
        return call

    def _count(self, fin: Finished) -> None:
        self.counters.prompt_tokens += fin.prompt_tokens
        self.counters.completion_tokens += fin.completion_tokens

    def _release(self, call: _Call) -> None:
        """The HTTP side is done with ``call``; abort it if the engine is not."""
        self._calls.pop(call.rid, None)
        if not call.ended:
            call.ended = True
            self.counters.aborted += 1
            self.service.abort(call.rid)

    async def _collect(self, call: _Call, request: Request) -> Finished:
        """Wait for the whole reply, aborting the request if the client disconnects."""

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self._release(call)

        watcher = asyncio.create_task(watch())
        try:
            async for ev in call.events():
                if isinstance(ev, Finished):
                    self._count(ev)
                    return ev
            raise ApiError(500, "the request ended without a result")
        finally:
            watcher.cancel()
            self._calls.pop(call.rid, None)

    def _stream(self, call: _Call, chunks: AsyncIterator[dict]) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks:
                    yield _sse(chunk)
            except ApiError as exc:
                yield _sse(exc.body)
            finally:  # also on cancellation: Starlette cancels us when the client disconnects
                self._release(call)
            yield _sse("[DONE]")

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)

    async def _chat_chunks(
        self, call: _Call, with_usage: bool, tool_format: str | None = None
    ) -> AsyncIterator[dict]:
        """The reply as chunks; with ``tool_format``, calls come out as ``delta.tool_calls``
        as OpenAI sends them (the id and name once, then argument fragments; a call not
        written name first comes whole when it closes), the text around them as content."""
        name, created = self.service.model_name, int(time.time())
        reader = StreamParser(tool_format) if tool_format else None
        n_calls = 0
        sent: tuple[str, str] | None = None  # the call streaming now: (id, arguments sent)

        def chunk(delta: dict | None, **kw) -> dict:
            return chat_chunk(call.rid, name, created, delta, with_usage=with_usage, **kw)

        def args_delta(arguments: str) -> dict:
            return chunk({"tool_calls": [{"index": n_calls, "function": {"arguments": arguments}}]})

        def deltas(text: str, calls: list) -> list[dict]:
            nonlocal n_calls, sent
            out = [chunk({"content": text})] if text else []
            for c in calls:
                if sent is not None and sent[0] == c.id:  # finish what streamed
                    if len(c.arguments) > len(sent[1]):
                        out.append(args_delta(c.arguments[len(sent[1]) :]))
                else:
                    out.append(chunk({"tool_calls": [c.openai(index=n_calls)]}))
                n_calls, sent = n_calls + 1, None
            part = reader.partial()
            if sent is not None and (part is None or part[0] != sent[0]):
                # It closed as no call (malformed): what streamed cannot be taken back, so
                # the next call takes the next index.
                n_calls, sent = n_calls + 1, None
            if part is not None:
                cid, fn, arguments = part
                if sent is None:
                    head = {"index": n_calls, "id": cid, "type": "function"}
                    out.append(
                        chunk({"tool_calls": [{**head, "function": {"name": fn, "arguments": ""}}]})
                    )
                    sent = (cid, "")
                if len(arguments) > len(sent[1]):
                    out.append(args_delta(arguments[len(sent[1]) :]))
                    sent = (cid, arguments)
            return out

        yield chunk({"role": "assistant", "content": ""})
        async for ev in call.events():
            if isinstance(ev, TokenEvent):
                if reader is None:
                    if ev.text:
                        yield chunk({"content": ev.text})
                else:
                    for c in deltas(*reader.feed(ev.text)):
                        yield c
                continue
            if reader is not None:
                for c in deltas(*reader.finish()):
                    yield c
            self._count(ev)
            yield chunk({}, finish="tool_calls" if n_calls else ev.reason)
            if with_usage:
                yield chunk(None, usage_=usage(ev))

    async def _completion_chunks(
        self, call: _Call, echo: str, with_usage: bool
    ) -> AsyncIterator[dict]:
        name, created = self.service.model_name, int(time.time())
        if echo:
            yield completion(call.rid, name, created, echo, None, with_usage=with_usage)
        async for ev in call.events():
            if isinstance(ev, TokenEvent):
                if ev.text:
                    yield completion(call.rid, name, created, ev.text, None, with_usage=with_usage)
                continue
            self._count(ev)
            yield completion(call.rid, name, created, "", ev.reason, with_usage=with_usage)
            if with_usage:
                yield completion(call.rid, name, created, "", None, usage(ev), choices=False)

    def abort_all(self) -> None:
        """Abort every request this server submitted (any thread)."""
        for rid in tuple(self._calls):
            self.service.abort(rid)

    # --- observability ------------------------------------------------------------------

    def stats(self) -> dict:
        s, c = self.service.latest, self.counters
        engine = (
            {
                "tokens_per_s": s.tokens_per_s,
                "tokens_total": s.tokens_total,
                "cache_hit_rate": s.hit_rate,
                "both_busy_pct": 100 * s.both_busy_frac,
                "compute_wait_pct": 100 * s.compute_wait_frac,
                "cache_slots": s.cache_slots,
                "cache_used": s.cache_used,
                "cache_pinned": s.cache_pinned,
                "runahead": s.runahead,
                "memory_mib": {
                    "rss": s.rss_bytes / 2**20,
                    "cache_budget": s.cache_budget_bytes / 2**20,
                    "cache_slots": s.slots_bytes / 2**20,
                    "working_set": s.working_set_bytes / 2**20,
                    "kv": s.kv_bytes / 2**20,
                    "dense_weights": s.dense_bytes / 2**20,
                },
                "snapshot_age_s": max(0.0, time.perf_counter() - s.t),
                "requests": [
                    {
                        "id": r.request_id,
                        "session": r.session,
                        "layer": r.layer,
                        "n_layers": r.n_layers,
                        "state": r.state,
                        "tokens": r.tokens,
                        "prompt_tokens": r.prompt_tokens,
                        "prompt_read": round(r.prompt_read, 4),
                    }
                    for r in s.requests
                ],
            }
            if s is not None
            else {"requests": []}
        )
        return {
            "model": self.service.model_name,
            "expert_backend": self.service.engine.expert_backend,
            # One snapshot's view: active_requests is len(requests). open_requests also
            # counts those submitted that the engine has not taken in yet.
            "active_requests": len(engine["requests"]),
            "open_requests": self.service.active,
            "max_queue": self.max_queue,
            **engine,
            "api": {
                "rejected": c.rejected,
                "aborted": c.aborted,
                "prompt_tokens": c.prompt_tokens,
                "completion_tokens": c.completion_tokens,
            },
        }

    def metrics_text(self) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        return render_metrics(self.service.latest, self.service.active, self.counters)
