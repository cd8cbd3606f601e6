"""Stop strings over streamed text: the same cut however the text is split, and limits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.config import MAX_STOP_CHARS, MAX_STOPS, SamplingParams
from backend.text.stops import StopMatcher


def reference(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """The text up to the stop string that ends first (the longest of those ending
    there), and that stop string."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            longest = max(ending, key=len)
            return text[: end - len(longest)], longest
    return text, None


def stream(text: str, stops: tuple[str, ...], cuts: list[int]) -> tuple[str, str | None]:
    m = StopMatcher(stops)
    out, last = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        out.append(m.feed(text[last:c]))
        last = c
    if not m.stopped:
        out.append(m.flush())
    assert m.stopped == (m.matched is not None)
    return "".join(out), m.matched


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=40),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=5), max_size=3).map(tuple),
    cuts=st.lists(st.integers(0, 40), max_size=12),
)
def test_streamed_text_is_cut_where_the_first_stop_ends(text, stops, cuts) -> None:
    cuts = [c for c in cuts if c <= len(text)]
    assert stream(text, stops, cuts) == reference(text, stops)


def test_held_back_text_is_the_longest_stop_prefix_only() -> None:
    m = StopMatcher(("abab", "xyz"))
    assert m.feed("zzaba") == "zz"  # "aba" could still become "abab"
    assert m.feed("c") == "abac"
    assert m.feed("x") == "" and m.feed("yz!") == "" and m.stopped


def test_adversarial_text_keeps_only_a_bounded_suffix() -> None:
    m = StopMatcher(("a" * 100 + "b",))
    for _ in range(1000):
        m.feed("a" * 7)
    assert len(m.pending) == 100  # never more than the stop string less one


@pytest.mark.parametrize(
    "stop, message",
    [
        (["x"] * (MAX_STOPS + 1), f"at most {MAX_STOPS} strings"),
        (["y" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS} characters"),
        ([""], "non-empty"),
    ],
)
def test_stop_lists_past_the_limits_are_refused(stop, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(stop=tuple(stop))
