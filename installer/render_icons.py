"""Render the SVG icons in ``assets/`` to the PNG sizes desktops look for and to a Windows .ico.

The SVGs are the source; the PNGs and .ico are committed so that building a package needs no Qt.
Run after changing an SVG (needs the gui extra): ``python installer/render_icons.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets"
ICONS = ("deskfleet-agent", "deskfleet-console")
PNG_SIZES = (16, 32, 48, 64, 128, 256)
ICO_SIZE = 128  # one image per .ico (what Qt writes); Windows scales it for shortcuts and the installer


def png_path(name: str, size: int) -> Path:
    return ASSETS / f"{name}-{size}.png"


def render(assets: Path = ASSETS) -> list[Path]:
    """Write ``<name>-<size>.png`` and ``<name>.ico`` next to each ``<name>.svg``."""
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    _app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])
    written = []
    for name in ICONS:
        renderer = QSvgRenderer(str(assets / f"{name}.svg"))
        if not renderer.isValid():
            raise SystemExit(f"{assets / name}.svg is not a valid SVG")
        for size in PNG_SIZES:
            image = QImage(size, size, QImage.Format.Format_ARGB32)
            image.fill(Qt.GlobalColor.transparent)
            painter = QPainter(image)
            painter.setRenderHint(QPainter.RenderHint.Antialiasing)
            renderer.render(painter)
            painter.end()
            image.save(str(assets / f"{name}-{size}.png"), "PNG")
            written.append(assets / f"{name}-{size}.png")
            if size == ICO_SIZE:
                image.save(str(assets / f"{name}.ico"), "ICO")
                written.append(assets / f"{name}.ico")
    return written


if __name__ == "__main__":
    for path in render():
        print(path)
