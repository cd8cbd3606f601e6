"""ASGI middleware in front of the API routes: authentication, body size, request counting.

It works at the ASGI level, below FastAPI, so a request with a wrong key or an oversized
declared body is answered before any route or body parsing runs, and every response,
including those errors and crashes, is counted by endpoint and status.
"""

from __future__ import annotations

import hmac
from typing import Protocol

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backend.serving.metrics_text import ApiCounters
from backend.serving.openai_schema import ApiError

MAX_BODY_BYTES = 32 << 20
_ENDPOINTS = (
    "/health",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/stats",
    "/metrics",
)


class Guarded(Protocol):
    """What the guard needs of the server it protects (``routes.ApiServer``)."""

    api_key: str | None
    counters: ApiCounters


def check_headers(
    api_key: str | None, path: str, headers: list[tuple[bytes, bytes]]
) -> ApiError | None:
    """An error for a request that must not reach the routes, or None."""
    h = dict(headers)
    if api_key and path != "/health":
        given = h.get(b"authorization", b"")
        if not hmac.compare_digest(given, f"Bearer {api_key}".encode()):
            what = "a wrong API key" if given else "no API key"
            return ApiError(
                401, f"{what}: send Authorization: Bearer <key>", code="invalid_api_key"
            )
    length = h.get(b"content-length", b"0")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        return ApiError(
            413, f"the body is larger than {MAX_BODY_BYTES >> 20} MiB", code="request_too_large"
        )
    return None


class Guard:
    """ASGI middleware: authentication and body size before any route; request counting."""

    def __init__(self, app: ASGIApp, api: Guarded) -> None:
        self.app, self.api = app, api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = "/v1/models" if path.startswith("/v1/models/") else path
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            error = check_headers(self.api.api_key, path, scope["headers"])
            if error is None:
                await self.app(scope, receive, counting_send)
            else:
                await JSONResponse(error.body, error.status)(scope, receive, counting_send)
        finally:
            key = endpoint if endpoint in _ENDPOINTS else "other"
            self.api.counters.requests[(key, status)] += 1
