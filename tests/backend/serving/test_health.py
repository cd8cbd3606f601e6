"""Server-side failures are the server's: a failing expert read answers 500
``server_error`` (not a 400 blaming the client) and /health says "degraded" until the
failures stop. The read fails by a scripted OSError at the store boundary."""

from __future__ import annotations

import asyncio
import errno
import time
from pathlib import Path

import httpx

from backend.config import EngineConfig
from backend.serving.routes import ApiServer
from backend.serving.service import DEGRADED_S, EngineService


def test_a_failing_expert_read_is_a_server_error_and_degrades_health(
    tiny_chat_moe: Path, monkeypatch
) -> None:
    svc = EngineService.open(tiny_chat_moe, EngineConfig(cache="0.5", storage="ssd", aio=False))
    try:

        def broken(ref, out):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(svc.engine.store, "read_into", broken)
        api = ApiServer(svc)

        async def go(path: str, body: dict | None = None) -> httpx.Response:
            transport = httpx.ASGITransport(app=api.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
                if body is None:
                    return await c.get(path)
                return await c.post(path, json=body)

        assert asyncio.run(go("/health")).json()["status"] == "ok"
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = asyncio.run(go("/v1/chat/completions", body))
        err = r.json()["error"]
        assert r.status_code == 500 and err["code"] == "server_error", r.text
        assert err["type"] == "server_error" and "Input/output error" in err["message"]
        health = asyncio.run(go("/health"))
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert "reading expert" in health.json()["error"]
        monkeypatch.undo()  # the disk is back; once failures stop, health recovers
        at, message = svc.last_server_error
        svc.last_server_error = (time.monotonic() - DEGRADED_S - 1, message)
        assert asyncio.run(go("/health")).json() == {
            "status": "ok",
            "model": svc.model_name,
            "error": None,
        }
        assert asyncio.run(go("/v1/chat/completions", body)).status_code == 200
    finally:
        svc.close()
