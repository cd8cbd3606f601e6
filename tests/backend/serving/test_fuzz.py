"""Generated requests against the real API app on a tiny MoE (in process, through the
guard and every route): whatever a client sends, no 5xx, and the engine still gives the
same greedy reply afterwards. Hypothesis draws the bodies; their count is bounded."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.config import EngineConfig
from backend.serving.routes import ApiServer
from backend.serving.service import EngineService

N_REQUESTS = 100

anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 40)
    | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
role = st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard", "", 3])
content = (
    st.none()
    | st.text(max_size=40)
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}
        ),
        max_size=2,
    )
    | anything
)
message = st.fixed_dictionaries(
    {"role": role, "content": content},
    optional={"tool_calls": anything, "tool_call_id": anything, "name": anything},
)
tool = (
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": st.sampled_from(["get_weather", "ls", ""])},
                optional={
                    "parameters": st.sampled_from(
                        [
                            {"type": "object"},
                            {
                                "type": "object",
                                "properties": {"x": {"type": "integer"}},
                                "required": ["x"],
                            },
                            {},
                            3,
                        ]
                    )
                },
            ),
        }
    )
    | anything
)
body = st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=0, max_size=3) | anything},
    optional={
        "max_tokens": st.integers(-2, 6) | anything,
        "temperature": st.floats(-1, 3) | st.just(float("nan")) | anything,
        "top_p": st.floats(-0.5, 1.5) | anything,
        "top_k": st.integers(-2, 50) | anything,
        "min_p": anything,
        "stop": st.lists(st.text(max_size=4), max_size=3) | anything,
        "stream": st.booleans() | anything,
        "seed": st.integers(-5, 2**40) | anything,
        "tools": st.lists(tool, max_size=2) | anything,
        "tool_choice": st.sampled_from(
            ["auto", "none", "required", {"type": "function", "function": {"name": "ls"}}]
        )
        | anything,
        "response_format": st.sampled_from(
            [
                {"type": "json_object"},
                {"type": "text"},
                {
                    "type": "json_schema",
                    "json_schema": {
                        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}
                    },
                },
            ]
        )
        | anything,
        "repetition_penalty": anything,
        "n": anything,
        "logprobs": anything,
        "model": anything,
        "extra_field": anything,
    },
)


@pytest.fixture(scope="module")
def api(tiny_chat_moe: Path):
    svc = EngineService.open(tiny_chat_moe, EngineConfig(cache="0.5"))
    yield ApiServer(svc)
    svc.close()


def _post(api: ApiServer, payload: bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=api.app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://127.0.0.1", timeout=120
        ) as c:
            return await c.post(path, content=payload, headers={"Content-Type": "application/json"})

    return asyncio.run(go())


GREEDY = {
    "messages": [{"role": "user", "content": "Tell me about rivers."}],
    "max_tokens": 8,
    "temperature": 0,
}


def test_generated_requests_get_no_server_error(api: ApiServer) -> None:
    before = _post(api, json.dumps(GREEDY).encode()).json()["choices"][0]["message"]["content"]
    seen: dict[int, int] = {}

    @settings(
        max_examples=N_REQUESTS,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(body)
    def one(b) -> None:
        for key in ("max_tokens",):  # keep the replies short: the count is the point
            if isinstance(b.get(key), int) and b[key] > 6:
                b[key] = 6
        r = _post(api, json.dumps(b, allow_nan=True).encode())
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (b, r.text)

    one()
    assert sum(seen.values()) == N_REQUESTS and 400 in seen and 200 in seen
    after = _post(api, json.dumps(GREEDY).encode()).json()["choices"][0]["message"]["content"]
    assert after == before  # the engine is alive and still exact
    assert api.service.active == 0
