"""The session sidebar: titles elided at word boundaries, badges that are never elided."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtGui import QFontMetrics
from pytestqt.qtbot import QtBot

from app.widgets.sessions import SessionList, elide_words

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
LONG = "Refactor the scheduler so that runahead requests never starve the link thread"


def test_titles_are_cut_at_a_word_boundary(qtbot: QtBot) -> None:
    sidebar = SessionList()
    qtbot.addWidget(sidebar)
    fm = QFontMetrics(sidebar.font())
    width = fm.horizontalAdvance("Refactor the scheduler so")
    cut = elide_words(fm, LONG, width)
    assert cut.endswith("…") and fm.horizontalAdvance(cut) <= width
    assert LONG.startswith(cut[:-1]) and LONG[len(cut) - 1] == " "  # a whole word ended it
    assert elide_words(fm, "short", 500) == "short"
    one_word = "x" * 200
    assert fm.horizontalAdvance(elide_words(fm, one_word, 50)) <= 50  # cut where it must be


def test_busy_and_agent_markers_are_badges_beside_any_title(qtbot: QtBot) -> None:
    sidebar = SessionList()
    qtbot.addWidget(sidebar)
    sidebar.set_sessions(
        [
            {"id": 1, "title": LONG, "kind": "agent"},
            {"id": 2, "title": LONG + " and more", "kind": "chat"},
            {"id": 3, "title": "Quick question", "kind": "chat"},
        ]
    )
    sidebar.set_busy(2, True)
    sidebar.set_activity(1, "running a tool")
    assert sidebar.badges(1) == ("agent", "▶")
    assert sidebar.badges(2) == ("●",)
    assert sidebar.badges(3) == ()
    assert sidebar.titles()[0] == LONG  # the title itself is kept whole (search, tooltip)
    sidebar.set_busy(2, False)
    assert sidebar.badges(2) == ()
    sidebar.set_busy(2, True)
    sidebar.resize(230, 300)
    sidebar.show()
    qtbot.waitExposed(sidebar)
    # The badges are drawn at the row's right edge: a badge's pixels differ from the
    # background there even though the title is far wider than the row.
    image = sidebar.view.viewport().grab().toImage()
    row = sidebar.view.visualRect(sidebar.proxy.index(1, 0))
    background = image.pixel(row.right() - 2, row.center().y())
    edge = {image.pixel(x, row.center().y()) for x in range(row.right() - 20, row.right() - 2)}
    assert len(edge - {background}) >= 1
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    sidebar.grab().save(str(ARTIFACTS / "sidebar_badges.png"))
