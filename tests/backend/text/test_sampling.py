from __future__ import annotations

import pytest
import torch

from backend.config import SamplingParams
from backend.models.generate import StopMatcher
from backend.text.sampling import make_generator, sample

LOGITS = torch.tensor([1.0, 3.0, 2.5, -1.0, 0.0])


def draw(params: SamplingParams, n: int = 400, history=()) -> list[int]:
    gen = make_generator(params)
    return [sample(LOGITS.clone(), params, gen, history) for _ in range(n)]


def test_greedy_is_argmax() -> None:
    assert set(draw(SamplingParams(temperature=0), 10)) == {1}


def test_seed_reproduces_and_differs() -> None:
    p = SamplingParams(temperature=1.0, top_p=1.0, seed=7)
    assert draw(p) == draw(p)
    assert draw(p) != draw(SamplingParams(temperature=1.0, top_p=1.0, seed=8))


def test_top_k_restricts() -> None:
    assert set(draw(SamplingParams(temperature=1.0, top_p=1.0, top_k=2, seed=1))) == {1, 2}


def test_top_p_keeps_smallest_prefix() -> None:
    probs = LOGITS.softmax(-1)  # ~[0.07, 0.52, 0.32, 0.01, 0.03]
    assert probs[1] < 0.6 < probs[1] + probs[2]
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.6, seed=1))) == {1, 2}
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.1, seed=1))) == {1}


def test_min_p_drops_unlikely_tokens() -> None:
    assert set(draw(SamplingParams(temperature=1.0, top_p=1.0, min_p=0.3, seed=1))) == {1, 2}


def test_low_temperature_sharpens() -> None:
    hot = draw(SamplingParams(temperature=2.0, top_p=1.0, seed=3))
    cold = draw(SamplingParams(temperature=0.2, top_p=1.0, seed=3))
    assert cold.count(1) > hot.count(1)


def test_repetition_penalty_discourages_seen_tokens() -> None:
    assert draw(SamplingParams(temperature=0, repetition_penalty=5.0), 1, history=[1]) == [2]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"min_p": 1.0},
        {"repetition_penalty": 0},
        {"max_tokens": 0},
        {"stop": ("",)},
        {"seed": -1},
        {"seed": 2**64},
        {"seed": 1.5},
    ],
)
def test_invalid_values_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_stop_matcher_holds_back_partial_matches() -> None:
    m = StopMatcher(("END",))
    assert m.feed("hello E") == "hello "
    assert m.feed("N") == ""
    assert m.feed("X") == "ENX"
    assert m.feed(" and EN") == " and "
    assert m.feed("D tail") == ""
    assert m.stopped


def test_stop_matcher_without_stops_passes_through() -> None:
    m = StopMatcher(())
    assert m.feed("abc") == "abc" and m.flush() == ""
