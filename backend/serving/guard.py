"""ASGI middleware in front of the API routes: browser safety, authentication, body
size, request counting.

It works at the ASGI level, below FastAPI, so a refused request is answered before any
route or body parsing runs, and every response, including those errors and crashes, is
counted by endpoint and status. What it refuses, as llama.cpp's server and Ollama do:

- a Host header naming anything but a loopback name, an IP address or an allowed name
  (DNS rebinding: a web page whose name resolves to 127.0.0.1 would otherwise reach the
  local model);
- a cross-origin browser request (an ``Origin`` header) from anywhere but a loopback
  origin or one allowed by ``--cors-origin``; and a browser POST that is not JSON (a
  ``text/plain`` form needs no preflight);
- a body past ``MAX_BODY_BYTES``, counted as it arrives (chunked uploads included): it
  is read here, never more than the limit, and handed to the routes whole.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from typing import Protocol
from urllib.parse import urlsplit

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backend.serving.api_errors import ApiError
from backend.serving.metrics_text import ApiCounters

MAX_BODY_BYTES = 32 << 20
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# The same loopback origins as a regex, for the CORS middleware's preflight answers.
LOOPBACK_ORIGIN = (
    r"[a-z][a-z0-9+.-]*://(localhost|[a-z0-9-]+\.localhost|127\.0\.0\.1|\[::1\])(:\d+)?"
)
log = logging.getLogger(__name__)
_ENDPOINTS = (
    "/",
    "/health",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/stats",
    "/metrics",
    "/api/chat",
    "/api/generate",
    "/api/tags",
    "/api/show",
    "/api/ps",
    "/api/version",
)


class Guarded(Protocol):
    """What the guard needs of the server it protects (``routes.ApiServer``)."""

    api_key: str | None
    counters: ApiCounters
    allowed_hosts: tuple[str, ...]  # Host names beyond loopback names and IPs; "*": any
    cors_origins: tuple[str, ...]  # origins beyond loopback ones; "*": any


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether a Host header (name[:port], [v6]:port) may reach the API."""
    if "*" in allowed:
        return True
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1 : name.find("]")] if "]" in name else name[1:]
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    name = name.rstrip(".")
    if not name:
        return False
    return (
        name in LOOPBACK_NAMES
        or name.endswith(".localhost")
        or _is_ip(name)
        or name in (a.lower() for a in allowed)
    )


def origin_allowed(origin: str, allowed: tuple[str, ...]) -> bool:
    """Whether a browser page at ``origin`` may call the API."""
    if "*" in allowed or origin in allowed:
        return True
    try:
        host = (urlsplit(origin).hostname or "").lower()
    except ValueError:
        return False
    return host in LOOPBACK_NAMES or host.endswith(".localhost")


def check_headers(
    api: Guarded, method: str, path: str, headers: list[tuple[bytes, bytes]]
) -> ApiError | None:
    """An error for a request that must not reach the routes, or None."""
    h = dict(headers)
    host = h.get(b"host", b"").decode("latin-1")
    if not host_allowed(host, api.allowed_hosts):
        return ApiError(
            403,
            f"Host {host!r} is not this server's (a DNS-rebinding guard); start the server "
            "with --allow-host NAME to serve that name",
            code="host_not_allowed",
        )
    origin = h.get(b"origin", b"").decode("latin-1")
    if origin and (origin == "null" or not origin_allowed(origin, api.cors_origins)):
        return ApiError(  # "null": a sandboxed frame or a file:// page, never allowed
            403,
            f"cross-origin request from {origin} refused; start the server with "
            f"--cors-origin {origin} to allow that page",
            code="origin_not_allowed",
        )
    if origin and method == "POST":
        kind = h.get(b"content-type", b"").split(b";")[0].strip().lower()
        if kind != b"application/json":
            return ApiError(
                415,
                "a browser request must send Content-Type: application/json",
                code="unsupported_media_type",
            )
    if api.api_key and path not in ("/", "/health"):
        # OpenAI and Ollama clients send a bearer token, Anthropic's send x-api-key.
        scheme, _, given = h.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer":
            given = h.get(b"x-api-key", b"")
        ok = bool(given) and hmac.compare_digest(given.strip(), api.api_key.encode())
        if not ok:
            what = "a wrong API key" if given or scheme else "no API key"
            return ApiError(
                401,
                f"{what}: send Authorization: Bearer <key> (or x-api-key: <key>)",
                code="invalid_api_key",
            )
    length = h.get(b"content-length", b"0")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        return _too_large()
    return None


def _too_large() -> ApiError:
    return ApiError(
        413, f"the body is larger than {MAX_BODY_BYTES >> 20} MiB", code="request_too_large"
    )


class _ClientLeft(Exception):
    """The client disconnected before its body arrived."""


async def _read_body(receive: Receive) -> bytes | None:
    """The whole body, or None once it passes MAX_BODY_BYTES (reading stops there)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientLeft
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class Guard:
    """ASGI middleware: browser safety, authentication and body size before any route;
    request counting."""

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
            error = check_headers(self.api, scope["method"], path, scope["headers"])
            inner = receive
            if error is None and scope["method"] in ("POST", "PUT", "PATCH"):
                body = await _read_body(receive)
                if body is None:
                    error = _too_large()
                else:
                    inner = _replay(body, receive)
            if error is None:
                await self.app(scope, inner, counting_send)
            else:
                response = JSONResponse(error.body_for(path), error.status)
                await response(scope, receive, counting_send)
        except _ClientLeft:
            status = 499  # nginx's "client closed request": not a server error
            log.info("%s: the client left before sending its whole body", path)
        finally:
            key = endpoint if endpoint in _ENDPOINTS else "other"
            self.api.counters.requests[(key, status)] += 1


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the routes: the body read already, then the client's own messages
    (a disconnect, while a reply streams)."""
    sent = False

    async def inner() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return inner
