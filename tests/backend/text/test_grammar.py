"""Constrained decoding: llguidance's masks over SmolLM2's real tokenizer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import pytest
import torch

from backend.config import Grammar
from backend.errors import BevyError
from backend.text.grammar import Matcher
from backend.text.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer"}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok(smollm2_gguf: Path) -> Tokenizer:
    meta = {k: f.contents() for k, f in gguf.GGUFReader(smollm2_gguf).fields.items()}
    return Tokenizer.from_gguf_metadata(meta, smollm2_gguf)


def walk(m: Matcher, tok: Tokenizer, text: str) -> list[bool]:
    """Feed ``text``'s tokens; whether each was admitted by the mask before it."""
    admitted = []
    for t in tok.encode(text, add_special=False):
        admitted.append(bool(m.allowed()[t]))
        assert m.accept(t)
    return admitted


def test_a_schema_admits_a_matching_reply_and_ends_with_it(tok: Tokenizer) -> None:
    m = Matcher(tok, tok.vocab_size, Grammar("json_schema", json.dumps(SCHEMA)))
    assert all(walk(m, tok, '{"answer": "no", "n": 42}'))
    assert m.done and m.accepting
    assert m.steps == len(tok.encode('{"answer": "no", "n": 42}', add_special=False))


def test_a_schema_refuses_what_cannot_match(tok: Tokenizer) -> None:
    m = Matcher(tok, tok.vocab_size, Grammar("json_schema", json.dumps(SCHEMA)))
    allowed = m.allowed()
    assert not allowed[tok.encode("Sure", add_special=False)[0]]
    assert all(tok.decode([i]).lstrip().startswith("{") for i in allowed.nonzero().flatten())
    assert m.accept(tok.encode('{"', add_special=False)[0])
    after = m.allowed()
    assert after[tok.encode("answer", add_special=False)[0]]
    assert not after[tok.encode("color", add_special=False)[0]]  # not a property


@pytest.mark.parametrize(
    "spec, text",
    [
        (Grammar("regex", r"[0-9]{3}-[a-z]+"), "123-abc"),
        (Grammar("lark", 'start: "yes" | "no"'), "no"),
        (Grammar("gbnf", 'root ::= "answer: " [0-9]+'), "answer: 7"),
    ],
)
def test_regex_lark_and_gbnf(tok: Tokenizer, spec: Grammar, text: str) -> None:
    m = Matcher(tok, tok.vocab_size, spec)
    assert all(walk(m, tok, text))
    assert m.accepting
    eos = next(iter(tok.eos_ids))
    assert m.done or m.allowed()[eos]  # complete: the reply may end here


def test_eos_only_once_the_match_is_complete(tok: Tokenizer) -> None:
    m = Matcher(tok, tok.vocab_size, Grammar("regex", r"[0-9]+!"))
    walk(m, tok, "12")
    assert not m.allowed()[next(iter(tok.eos_ids))] and not m.accepting


@pytest.mark.parametrize(
    "spec",
    [
        Grammar("json_schema", "{not json"),
        Grammar("lark", "start: undefined_rule"),
        Grammar("gbnf", "root ::= ("),
    ],
)
def test_bad_grammars_are_clear_errors(tok: Tokenizer, spec: Grammar) -> None:
    with pytest.raises(BevyError, match=f"invalid {spec.kind} grammar"):
        Matcher(tok, tok.vocab_size, spec)


def test_the_mask_is_computed_beside_the_caller(tok: Tokenizer) -> None:
    """After a token is accepted, the next mask is already under way on the worker."""
    m = Matcher(tok, tok.vocab_size, Grammar("json_schema", json.dumps(SCHEMA)))
    m.allowed()
    m.accept(tok.encode("{", add_special=False)[0])
    assert m._next is not None  # submitted, not computed on the caller's thread
    m.close()
    assert m._next is None and m.mask_s > 0
    assert torch.is_tensor(m.allowed())


def test_state_is_read_without_touching_the_matcher_while_a_mask_computes(tok: Tokenizer) -> None:
    """llguidance's matcher refuses a second caller while it computes a mask ("Already
    mutably borrowed"): ``done`` and ``accepting`` must not reach it then, or the engine
    thread would fail between two masks."""
    schema = json.dumps({"type": "object"})  # open: every mask walks much of the vocab
    for _ in range(5):
        m = Matcher(tok, tok.vocab_size, Grammar("json_schema", schema))
        m.allowed()
        m.accept(tok.encode("{", add_special=False)[0])
        end = time.perf_counter() + 0.03
        while time.perf_counter() < end:  # while the worker computes the next mask
            assert not m.done
            m.accepting  # noqa: B018
            time.sleep(0)  # let the worker take the GIL and start
        m.close()
