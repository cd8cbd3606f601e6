"""Render bevy-desktop.svg into the PNG sizes Briefcase installs (bevy-desktop-<size>.png).

Run after editing the SVG: ``.venv/bin/python packaging/icons/render.py``."""

import sys
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer

HERE = Path(__file__).parent
SIZES = (16, 32, 64, 128, 256, 512)


def main() -> int:
    app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])
    renderer = QSvgRenderer(str(HERE / "bevy-desktop.svg"))
    if not renderer.isValid():
        print("render.py: bevy-desktop.svg is not a valid SVG", file=sys.stderr)
        return 1
    for size in SIZES:
        image = QImage(size, size, QImage.Format.Format_ARGB32)
        image.fill(Qt.GlobalColor.transparent)
        painter = QPainter(image)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        renderer.render(painter)
        painter.end()
        image.save(str(HERE / f"bevy-desktop-{size}.png"))
    del app
    return 0


if __name__ == "__main__":
    sys.exit(main())
