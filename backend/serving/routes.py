"""The API as a FastAPI app over one EngineService: OpenAI's routes, and the requests
every dialect shares (admission, prompts, collecting or streaming a reply).

Each HTTP request becomes one engine request (``calls.Call``), whose events reach the
server's event loop; everything else runs on that loop. A client that goes away
mid-request aborts it, which releases its cache pins. Ollama's routes
(``ollama_api``) and Anthropic's (``anthropic_api``) are added to the same app and
share one queue and its limits. Starting and stopping a server around this app is
``backend.serving.http``'s job.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from backend.config import SamplingParams
from backend.errors import BevyError, ContextTooLong
from backend.messages import Finished, Submit, TokenEvent
from backend.models.generate import fit_chat, prompt_room
from backend.serving import anthropic_api, ollama_api
from backend.serving.api_errors import ApiError
from backend.serving.calls import (
    Call,
    CallArgs,
    CallDone,
    CallOpen,
    Done,
    Text,
    chat_parts,
    parse_body,
)
from backend.serving.guard import LOOPBACK_ORIGIN, Guard
from backend.serving.metrics_text import ApiCounters, render_metrics
from backend.serving.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_completion,
    completion,
    model_card,
    usage,
)
from backend.serving.remote import snapshot_json
from backend.serving.service import EngineService
from backend.text.tool_calls import parse, tool_syntax


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
        self._calls: dict[str, Call] = {}
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
            allow_headers=[
                "Authorization",
                "Content-Type",
                "x-api-key",
                "anthropic-version",
                "anthropic-beta",
                "anthropic-dangerous-direct-browser-access",
            ],
        )
        name = self.service.model_name

        # Errors in the shape of the dialect the path belongs to.
        @app.exception_handler(ApiError)
        async def api_error(request: Request, exc: ApiError) -> Response:
            return JSONResponse(exc.body_for(request.url.path), exc.status)

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, exc: HTTPException) -> Response:
            err = ApiError(exc.status_code, str(exc.detail))
            return JSONResponse(err.body_for(request.url.path), err.status)

        @app.exception_handler(Exception)
        async def crashed(request: Request, exc: Exception) -> Response:
            err = ApiError(500, f"internal error: {exc!r}")
            return JSONResponse(err.body_for(request.url.path), err.status)

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
            body = await parse_body(request, ChatCompletionRequest)
            self._check_model(body.model)
            call, reader = await self.start_chat(body, "chatcmpl")
            if body.stream:
                with_usage = bool(body.stream_options and body.stream_options.include_usage)
                return self._stream(call, self._chat_chunks(call, with_usage, reader))
            fin = await self.collect(call, request)
            content, calls = parse(fin.text, reader) if reader else (fin.text, [])
            return JSONResponse(chat_completion(call.rid, name, content, fin, calls))

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await parse_body(request, CompletionRequest)
            self._check_model(body.model)
            params = body.params()
            prompt = body.prompt_text_or_ids()
            call = await self.start("cmpl", params, lambda: self._completion_ids(prompt))
            echo = ""
            if body.echo:
                tok = self.service.model.tokenizer
                echo = prompt if isinstance(prompt, str) else tok.decode(prompt)
            if body.stream:
                with_usage = bool(body.stream_options and body.stream_options.include_usage)
                return self._stream(call, self._completion_chunks(call, echo, with_usage))
            fin = await self.collect(call, request)
            text = echo + fin.text
            return JSONResponse(
                completion(call.rid, name, int(time.time()), text, fin.reason, usage(fin))
            )

        @app.get("/v1/stats")
        async def stats(snapshot: bool = False) -> dict:
            # ?snapshot=1: the engine's whole latest snapshot too (lanes, residency), for
            # a desktop app drawing this server's panels (backend/serving/remote.py).
            out = self.stats()
            if snapshot and self.service.latest is not None:
                out["snapshot"] = snapshot_json(self.service.latest)
            return out

        @app.get("/metrics")
        async def metrics() -> Response:
            return PlainTextResponse(
                self.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8"
            )

        @app.get("/")
        async def root() -> Response:  # Ollama clients probe the root before anything else
            return PlainTextResponse("Bevy is running")

        ollama_api.add_routes(app, self)
        anthropic_api.add_routes(app, self)
        return app

    # --- requests -----------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        # The one model this server runs answers to its id (the file's stem), its file
        # name and "default", in any case: clients often keep a fixed model name. Ollama
        # clients add the tag ":latest" (as /api/tags lists it).
        names = {self.service.model_name, self.service.model.path.name, "default"}
        if model and model.casefold().removesuffix(":latest") not in {n.casefold() for n in names}:
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

    async def start_chat(
        self,
        body: ChatCompletionRequest,
        prefix: str,
        dialect: str = "openai",
        context: int | None = None,
        overflow: str | None = None,
        head_ids: tuple[int, ...] | list[int] = (),
    ) -> tuple[Call, str | None]:
        """Submit a chat (any dialect, as an OpenAI request): the call, and the tool-call
        format to read its reply with (None when it uses no tools). ``context``: a
        smaller context than the model's (Ollama's ``num_ctx``): the prompt is fitted
        into it and the reply stops at its end. ``overflow``: the policy for a prompt
        too long for it (default: the body's, else an error). ``head_ids``: tokens
        before the rendered chat (Ollama's ``context``)."""
        tok = self.service.model.tokenizer
        syntax = tool_syntax(tok.chat_template, tok.special_id)
        fmt = syntax.fmt
        params = body.params(syntax)
        messages, tools = body.chat_messages(fmt), body.chat_tools(fmt)
        continues = body.continues()
        overflow = overflow or body.context_overflow or "error"
        ctx = self.service.model.config.context_length
        ctx = min(ctx, context) if context else ctx
        room = ctx - 1 - min(params.max_tokens, ctx // 4) - len(head_ids)

        def ids() -> list[int]:
            if room < 1:
                raise ApiError(
                    400,
                    f"the context holds {len(head_ids)} tokens; it leaves no room in {ctx}",
                    param="context",
                    code="context_length_exceeded",
                )
            return self._check_prompt(
                [*head_ids, *self._chat_ids(messages, tools, overflow, room, continues)],
                "messages",
            )

        def fit(n_prompt: int) -> SamplingParams:  # the reply ends where ``context`` does
            return replace(params, max_tokens=max(1, min(params.max_tokens, ctx - n_prompt)))

        call = await self.start(prefix, fit if context else params, ids, dialect)
        return call, fmt if body.uses_tools else None

    def _chat_ids(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        overflow: str = "error",
        room: int | None = None,
        continue_final: bool = False,
    ) -> list[int]:
        """The prompt's ids in at most ``room`` tokens (default: the context less room
        for a reply); ``continue_final``: the reply goes on with the last message."""
        model = self.service.model
        room = prompt_room(model, 0) if room is None else room
        try:
            ids, _ = fit_chat(model, messages, tools, room, overflow, continue_final)
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

    async def start(
        self,
        prefix: str,
        params: SamplingParams | Callable[[int], SamplingParams],
        prompt_ids: Callable[[], list[int]],
        dialect: str = "openai",
    ) -> Call:
        """Admit (429 when the queue is full), tokenize off the loop, submit.
        ``params`` may depend on the prompt's length (a callable of it)."""
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
            if callable(params):
                params = params(len(ids))
            rid = self.service.new_id(prefix)
            call = Call(self.service, rid, asyncio.get_running_loop(), dialect, ids)
            self._calls[rid] = call
            self.service.submit(Submit(rid, params, prompt_ids=ids, session="api"), call.listener)
        finally:
            self._reserved -= 1
        return call

    def count(self, fin: Finished) -> None:
        self.counters.prompt_tokens += fin.prompt_tokens
        self.counters.completion_tokens += fin.completion_tokens

    def release(self, call: Call) -> None:
        """The HTTP side is done with ``call``; abort it if the engine is not."""
        self._calls.pop(call.rid, None)
        if not call.ended:
            call.ended = True
            self.counters.aborted += 1
            self.service.abort(call.rid)

    async def collect(self, call: Call, request: Request) -> Finished:
        """Wait for the whole reply, aborting the request if the client disconnects."""

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.release(call)

        watcher = asyncio.create_task(watch())
        try:
            async for ev in call.events():
                if isinstance(ev, Finished):
                    self.count(ev)
                    return ev
            raise ApiError(500, "the request ended without a result")
        finally:
            watcher.cancel()
            self._calls.pop(call.rid, None)

    def _stream(self, call: Call, chunks: AsyncIterator[dict]) -> StreamingResponse:
        async def frames() -> AsyncIterator[bytes]:
            async for chunk in chunks:
                yield _sse(chunk)
            yield _sse("[DONE]")

        def error(exc: ApiError) -> bytes:
            return _sse(exc.body) + _sse("[DONE]")

        return self.stream(call, frames(), error, "text/event-stream")

    def stream(
        self,
        call: Call,
        frames: AsyncIterator[bytes],
        error: Callable[[ApiError], bytes],
        media_type: str,
    ) -> StreamingResponse:
        """A streamed reply of ``call`` (any dialect): its ``frames``, and ``error``'s
        frame where the request fails mid-stream. The request is aborted when the
        client goes."""

        async def body() -> AsyncIterator[bytes]:
            try:
                async for frame in frames:
                    yield frame
            except ApiError as exc:
                yield error(exc)
            finally:  # also on cancellation: Starlette cancels us when the client disconnects
                self.release(call)

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(body(), media_type=media_type, headers=headers)

    async def _chat_chunks(
        self, call: Call, with_usage: bool, tool_format: str | None = None
    ) -> AsyncIterator[dict]:
        """The reply as chunks; with ``tool_format``, calls come out as ``delta.tool_calls``
        as OpenAI sends them (the id and name once, then argument fragments; a call not
        written name first comes whole when it closes), the text around them as content."""
        name, created = self.service.model_name, int(time.time())

        def chunk(delta: dict | None, **kw) -> dict:
            return chat_chunk(call.rid, name, created, delta, with_usage=with_usage, **kw)

        yield chunk({"role": "assistant", "content": ""})
        async for part in chat_parts(call, tool_format):
            if isinstance(part, Text):
                yield chunk({"content": part.text})
            elif isinstance(part, CallOpen):
                head = {"index": part.index, "id": part.id, "type": "function"}
                fn = {"name": part.name, "arguments": ""}
                yield chunk({"tool_calls": [{**head, "function": fn}]})
            elif isinstance(part, CallArgs):
                fn = {"arguments": part.fragment}
                yield chunk({"tool_calls": [{"index": part.index, "function": fn}]})
            elif isinstance(part, CallDone) and not part.streamed:
                yield chunk({"tool_calls": [part.call.openai(index=part.index)]})
            elif isinstance(part, Done):
                self.count(part.fin)
                yield chunk({}, finish="tool_calls" if part.opened else part.fin.reason)
                if with_usage:
                    yield chunk(None, usage_=usage(part.fin))

    async def _completion_chunks(
        self, call: Call, echo: str, with_usage: bool
    ) -> AsyncIterator[dict]:
        name, created = self.service.model_name, int(time.time())
        if echo:
            yield completion(call.rid, name, created, echo, None, with_usage=with_usage)
        async for ev in call.events():
            if isinstance(ev, TokenEvent):
                if ev.text:
                    yield completion(call.rid, name, created, ev.text, None, with_usage=with_usage)
                continue
            self.count(ev)
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
                # Fewer than the most while other processes keep CPUs busy.
                "compute_threads": s.compute_threads,
                "compute_threads_max": s.compute_threads_max,
                "warm_up_left": s.warm_left,  # experts still to read at start
                "memory_mib": {
                    "rss": s.rss_bytes / 2**20,
                    "device": s.device_bytes / 2**20,  # on CUDA: what the budget bounds
                    "budget": s.memory_budget_bytes / 2**20,  # 0: an explicit --cache
                    "cache_budget": s.cache_budget_bytes / 2**20,
                    "cache_slots": s.slots_bytes / 2**20,
                    "working_set": s.working_set_bytes / 2**20,
                    "kv": s.kv_bytes / 2**20,
                    "kv_budget": s.kv_budget_bytes / 2**20,
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
                        # The API dialect of a request this server took (None: the app's).
                        "dialect": call.dialect
                        if (call := self._calls.get(r.request_id))
                        else None,
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
