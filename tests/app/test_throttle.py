from __future__ import annotations

import pytest
from pytestqt.qtbot import QtBot

from app.throttle import Throttle


def test_burst_delivers_few_values_and_the_newest_last(qtbot: QtBot) -> None:
    got: list[int] = []
    throttle = Throttle(50, callback=got.append)
    with qtbot.waitSignal(throttle.delivered, timeout=1000) as blocker:
        for i in range(1000):
            throttle.push(i)
    assert blocker.args == [0]  # a value after a quiet period goes out at once
    qtbot.waitUntil(lambda: got and got[-1] == 999, timeout=1000)
    assert got == [0, 999]  # everything in between was overwritten, never delivered


def test_nothing_is_delivered_when_nothing_new_arrived(qtbot: QtBot) -> None:
    throttle = Throttle(30)
    got: list[object] = []
    throttle.delivered.connect(got.append)
    throttle.push("a")
    throttle.push("b")
    qtbot.waitUntil(lambda: got == ["a", "b"], timeout=1000)
    qtbot.wait(150)  # several intervals with no push
    assert got == ["a", "b"]
    assert not throttle.pending


def test_rate_is_capped_under_a_steady_stream(qtbot: QtBot) -> None:
    throttle = Throttle(40)
    got: list[int] = []
    throttle.delivered.connect(got.append)
    for i in range(60):  # one value every 5 ms for 300 ms
        throttle.push(i)
        qtbot.wait(5)
    qtbot.waitUntil(lambda: got[-1] == 59, timeout=1000)
    # At most one per 40 ms interval over ~300 ms (plus the immediate first one); the timer
    # is coarse under load, so allow slack but far fewer than the 60 pushed.
    assert 2 <= len(got) <= 12
    assert got == sorted(got)


def test_spaced_values_each_arrive(qtbot: QtBot) -> None:
    throttle = Throttle(20)
    got: list[object] = []
    throttle.delivered.connect(got.append)
    for value in ("x", None, 3):  # None is a value like any other
        with qtbot.waitSignal(throttle.delivered, timeout=1000):
            throttle.push(value)
        qtbot.wait(40)
    assert got == ["x", None, 3]


def test_flush_and_cancel(qtbot: QtBot) -> None:
    throttle = Throttle(10_000)  # long enough that only flush can deliver the second value
    got: list[int] = []
    throttle.delivered.connect(got.append)
    throttle.push(1)
    throttle.push(2)
    assert throttle.pending
    throttle.flush()
    assert got == [1, 2]
    throttle.push(3)
    throttle.cancel()
    throttle.flush()
    assert got == [1, 2] and not throttle.pending
    throttle.push(4)  # cancel ended the interval: the next value goes out at once
    assert got == [1, 2, 4]
    assert throttle.interval_ms == 10_000


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_ms"):
        Throttle(0)
