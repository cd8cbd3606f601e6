"""The API's guard on its own (a stand-in app behind it records what got through):
DNS rebinding, cross-origin browser requests, bearer schemes, body limits while the body
streams in, clients that leave mid-upload."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from starlette.responses import JSONResponse

from backend.serving import guard as guard_mod
from backend.serving.guard import Guard, host_allowed, origin_allowed
from backend.serving.metrics_text import ApiCounters


def make(api_key=None, hosts=(), origins=()):
    seen: list[bytes] = []

    async def app(scope, receive, send):
        message = await receive()
        seen.append(message.get("body", b""))
        await JSONResponse({"ok": True})(scope, receive, send)

    api = SimpleNamespace(
        api_key=api_key, counters=ApiCounters(), allowed_hosts=hosts, cors_origins=origins
    )
    return Guard(app, api), api, seen


def call(g, method="POST", url="http://127.0.0.1:8080/v1/chat/completions", **kw):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=g)) as c:
            return await c.request(method, url, **kw)

    return asyncio.run(go())


@pytest.mark.parametrize(
    "host, ok",
    [
        ("127.0.0.1:8080", True),
        ("localhost", True),
        ("[::1]:8080", True),
        ("192.168.1.20:8080", True),  # an address cannot be rebound
        ("app.localhost", True),
        ("attacker.example", False),
        ("attacker.example:8080", False),
        ("", False),
    ],
)
def test_host_names_that_could_be_rebound_are_refused(host: str, ok: bool) -> None:
    assert host_allowed(host, ()) is ok
    assert host_allowed("myhost.lan:8080", ("myhost.lan",))
    assert host_allowed("anything", ("*",))


def test_a_rebound_host_gets_403_and_never_reaches_the_routes() -> None:
    g, api, seen = make()
    r = call(g, json={}, headers={"Host": "attacker.example"})
    assert r.status_code == 403 and "--allow-host" in r.json()["error"]["message"]
    assert seen == []
    assert call(g, json={}).status_code == 200 and len(seen) == 1


def test_cross_origin_browser_requests_are_refused_unless_allowed() -> None:
    g, _, seen = make()
    evil = call(
        g, content=b"{}", headers={"Origin": "http://evil.example", "Content-Type": "text/plain"}
    )
    assert evil.status_code == 403 and "--cors-origin http://evil.example" in evil.text
    plain = call(
        g, content=b"{}", headers={"Origin": "http://localhost:3000", "Content-Type": "text/plain"}
    )
    assert plain.status_code == 415  # a simple (no-preflight) form post from a page
    ok = call(g, json={}, headers={"Origin": "http://localhost:3000"})
    assert ok.status_code == 200
    assert seen == [b"{}"]
    assert origin_allowed("http://myhost:3000", ("http://myhost:3000",))
    assert not origin_allowed("http://localhost.evil.example", ())
    g2, _, _ = make(origins=("http://myhost:3000",))
    assert call(g2, json={}, headers={"Origin": "http://myhost:3000"}).status_code == 200
    assert call(g, json={}, headers={"Origin": "null"}).status_code == 403


def test_the_bearer_scheme_is_case_insensitive_and_the_key_exact() -> None:
    g, _, _ = make(api_key="k1")
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert call(g, json={}, headers={"Authorization": f"{scheme} k1"}).status_code == 200
    assert call(g, json={}, headers={"Authorization": "Bearer k2"}).status_code == 401
    assert call(g, json={}, headers={"Authorization": "Basic k1"}).status_code == 401
    assert call(g, json={}).status_code == 401


def test_a_chunked_body_past_the_limit_is_refused_while_it_streams(monkeypatch) -> None:
    monkeypatch.setattr(guard_mod, "MAX_BODY_BYTES", 1 << 20)
    sent = 0

    async def upload():
        nonlocal sent
        for _ in range(600):  # 600 chunks of 1 MiB would be 600 MiB
            sent += 1
            yield b"x" * (1 << 20)

    g, api, seen = make()
    r = call(g, content=upload())  # no Content-Length: chunked
    assert r.status_code == 413 and seen == []
    assert sent <= 3  # reading stopped at the limit: memory stays flat

    async def two_chunks():
        yield b'{"a": '
        yield b"1}"

    small = call(g, content=two_chunks())
    assert small.status_code == 200 and seen == [b'{"a": 1}']  # handed on whole
    assert api.counters.requests[("/v1/chat/completions", 413)] == 1


def test_a_client_leaving_mid_upload_is_not_a_server_error(caplog) -> None:
    g, api, seen = make()

    async def go():
        messages = iter(
            [
                {"type": "http.request", "body": b'{"a":', "more_body": True},
                {"type": "http.disconnect"},
            ]
        )
        sent = []

        async def receive():
            return next(messages)

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": [(b"host", b"127.0.0.1:8080")],
        }
        await g(scope, receive, send)
        return sent

    with caplog.at_level("INFO", logger="backend.serving.guard"):
        sent = asyncio.run(go())
    assert sent == [] and seen == []
    assert api.counters.requests[("/v1/chat/completions", 499)] == 1
    assert not any(status >= 500 for (_, status) in api.counters.requests)
    assert [r.message for r in caplog.records] == [
        "/v1/chat/completions: the client left before sending its whole body"
    ]
