"""Constrained requests in the engine: their replies match their grammar, and the free
requests beside them get the same tokens as without them."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from backend.config import EngineConfig, Grammar, SamplingParams
from backend.engine.loop import Engine
from backend.messages import ErrorEvent, Finished, Submit
from backend.models.loader import LoadedModel, load_model
from tests.helpers.engine_runs import drain

SCHEMAS = [
    {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer"}},
        "required": ["answer", "n"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
]
FREE = [[3, 17, 42, 5, 88], [4, 4, 60], [10, 11, 12, 13]]


@pytest.fixture(scope="module")
def model(tiny_chat_moe: Path) -> LoadedModel:
    return load_model(tiny_chat_moe)


def run(model: LoadedModel, policy: str, constrained: bool) -> dict[str, Finished]:
    eng = Engine(model, EngineConfig(policy=policy, cache="0.5", storage="host"))
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    try:
        for i, p in enumerate(FREE):
            eng.submit(Submit(f"free{i}", free, prompt_ids=p))
        if constrained:
            for i, schema in enumerate(SCHEMAS):
                params = SamplingParams(
                    temperature=0.8,
                    seed=i,
                    max_tokens=64,
                    grammar=Grammar("json_schema", json.dumps(schema)),
                )
                msgs = [{"role": "user", "content": "Answer in JSON."}]
                eng.submit(Submit(f"json{i}", params, messages=msgs))
        eng.run_until_idle(120)
        events = drain(eng)
        assert not [e for e in events if isinstance(e, ErrorEvent)]
        assert sum(eng.cache.refs) == 0
        return {e.request_id: e for e in events if isinstance(e, Finished)}
    finally:
        eng.close()


@pytest.mark.parametrize("policy", ["bevy", "sync"])
def test_constrained_replies_match_and_free_ones_do_not_change(model, policy: str) -> None:
    alone = run(model, policy, constrained=False)
    mixed = run(model, policy, constrained=True)
    for i in range(len(FREE)):
        assert mixed[f"free{i}"].token_ids == alone[f"free{i}"].token_ids
    for i, schema in enumerate(SCHEMAS):
        fin = mixed[f"json{i}"]
        assert fin.reason == "stop", fin.text  # the grammar ended it, not max_tokens
        jsonschema.validate(json.loads(fin.text), schema)


def test_a_bad_grammar_fails_its_request_alone(model) -> None:
    eng = Engine(model, EngineConfig(cache="0.5", storage="host"))
    try:
        bad = SamplingParams(max_tokens=4, grammar=Grammar("json_schema", "{nope"))
        eng.submit(Submit("bad", bad, prompt_ids=[1, 2, 3]))
        eng.submit(Submit("ok", SamplingParams(temperature=0, max_tokens=3), prompt_ids=[1, 2]))
        eng.run_until_idle(60)
        events = drain(eng)
    finally:
        eng.close()
    errors = [e for e in events if isinstance(e, ErrorEvent)]
    assert [e.request_id for e in errors] == ["bad"] and "invalid json_schema" in errors[0].message
    assert any(isinstance(e, Finished) and e.request_id == "ok" for e in events)


def test_a_grammar_that_fails_mid_reply_fails_its_request_alone(model, monkeypatch) -> None:
    """llguidance can stop a matcher mid-reply (a grammar past its limits): that request
    ends with an error; the others finish and no pin is left. (The failure is scripted at
    the library boundary: no small grammar reaches those limits.)"""
    from backend.text.grammar import Matcher

    real = Matcher.allowed
    calls = [0]

    def failing(self):
        calls[0] += 1
        return None if calls[0] > 2 else real(self)

    monkeypatch.setattr(Matcher, "allowed", failing)
    monkeypatch.setattr(Matcher, "error", property(lambda self: "too complex"))
    eng = Engine(model, EngineConfig(cache="0.5", storage="host"))
    try:
        params = SamplingParams(
            max_tokens=20, grammar=Grammar("json_schema", json.dumps(SCHEMAS[0]))
        )
        eng.submit(Submit("json", params, prompt_ids=[1, 2, 3]))
        eng.submit(Submit("free", SamplingParams(temperature=0, max_tokens=4), prompt_ids=[5]))
        eng.run_until_idle(60)
        events = drain(eng)
        assert sum(eng.cache.refs) == 0
    finally:
        eng.close()
    errors = [e for e in events if isinstance(e, ErrorEvent)]
    assert [(e.request_id, e.message) for e in errors] == [
        ("json", "constrained decoding failed: too complex")
    ]
    assert any(isinstance(e, Finished) and e.request_id == "free" for e in events)
