"""Colours for the panels, derived from the widget palette so dark and light themes both read.

pyqtgraph defaults to a black background with grey text whatever the Qt palette says, so every
plot here takes its background, text and grid colours from the palette explicitly, and the
accent colours are picked per theme: saturated mid tones on dark backgrounds, deeper tones
on light ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyqtgraph as pg
from PySide6.QtCore import QEvent
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QLabel, QWidget

# Qualitative colours for per-session lines: (dark theme, light theme).
_SERIES = (
    ("#4e9bff", "#1f5fbf"),
    ("#ff9f43", "#c25e00"),
    ("#3ddc97", "#11845a"),
    ("#ff6b81", "#c0243b"),
    ("#b48cff", "#6a3fc0"),
    ("#e6d74a", "#8a7a00"),
    ("#4dd0e1", "#00798a"),
    ("#f78fb3", "#a63c6b"),
)


@dataclass(frozen=True)
class PanelTheme:
    """Colours one panel draws with; build it with :func:`theme_for`."""

    dark: bool
    background: QColor
    foreground: QColor
    muted: QColor  # secondary text, axis lines, empty tracks
    grid: QColor
    link: QColor
    compute: QColor
    both: QColor  # both lanes busy at once
    good: QColor
    warn: QColor
    neutral: QColor
    accent: QColor

    def series(self, index: int) -> QColor:
        """Colour of the ``index``-th data series (cycles through eight)."""
        dark, light = _SERIES[index % len(_SERIES)]
        return QColor(dark if self.dark else light)

    def hex(self, color: QColor) -> str:
        """``#rrggbb`` of a colour, for rich-text labels."""
        return color.name()


def mix(a: QColor, b: QColor, t: float) -> QColor:
    """The opaque colour ``t`` of the way from ``a`` to ``b``."""
    return QColor(
        round(a.red() * (1 - t) + b.red() * t),
        round(a.green() * (1 - t) + b.green() * t),
        round(a.blue() * (1 - t) + b.blue() * t),
    )


def theme_for(widget: QWidget) -> PanelTheme:
    """The theme matching ``widget``'s current palette."""
    pal = widget.palette()
    background = pal.color(QPalette.ColorRole.Base)
    foreground = pal.color(QPalette.ColorRole.Text)
    dark = background.lightnessF() < 0.5
    muted = mix(background, foreground, 0.55)
    grid = mix(background, foreground, 0.18)
    if dark:
        link, compute, both = QColor("#4e9bff"), QColor("#3ddc97"), QColor("#ffcc4d")
        good, warn, neutral = QColor("#3ddc97"), QColor("#ffb347"), QColor("#9aa0a6")
    else:
        link, compute, both = QColor("#1f6fd1"), QColor("#13935f"), QColor("#e0a100")
        good, warn, neutral = QColor("#13935f"), QColor("#c76a00"), QColor("#7b8187")
    return PanelTheme(
        dark=dark,
        background=background,
        foreground=foreground,
        muted=muted,
        grid=grid,
        link=link,
        compute=compute,
        both=both,
        good=good,
        warn=warn,
        neutral=neutral,
        accent=link,
    )


def style_plot(plot: pg.PlotWidget, theme: PanelTheme) -> None:
    """Apply ``theme`` to a plot: background, axes, tick text, and a static, non-interactive
    view (live panels redraw ten times a second, so panning would be undone at once)."""
    plot.setBackground(theme.background)
    item = plot.getPlotItem()
    for name in ("left", "bottom", "right", "top"):
        axis = item.getAxis(name)
        axis.setPen(pg.mkPen(theme.muted))
        axis.setTextPen(pg.mkPen(theme.foreground))  # also colours the axis label


def make_plot(theme: PanelTheme) -> pg.PlotWidget:
    """A plot widget set up for a live panel: no mouse interaction, no context menu."""
    plot = pg.PlotWidget()
    item = plot.getPlotItem()
    item.setMenuEnabled(False)
    item.hideButtons()
    item.setMouseEnabled(x=False, y=False)
    item.getViewBox().setDefaultPadding(0.0)
    style_plot(plot, theme)
    return plot


def set_swatch(label: QLabel, color: QColor) -> None:
    """Make ``label`` a small legend square of ``color``."""
    label.setFixedSize(12, 12)
    label.setStyleSheet(f"background: {color.name()}; border-radius: 3px;")


class ThemedPanel(QWidget):
    """A panel drawn in its palette's colours; redraws them when the palette changes
    (dark/light switch while running). Subclasses implement ``_apply_theme``."""

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 (Qt override)
        if event.type() == QEvent.Type.PaletteChange:
            self._apply_theme(theme_for(self))
        super().changeEvent(event)

    def _apply_theme(self, theme: PanelTheme) -> None:
        raise NotImplementedError
