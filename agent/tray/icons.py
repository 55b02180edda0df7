"""The tray icon for each agent state, drawn with QPainter (no image files to ship or theme).

Each state differs in colour *and* in its glyph, so the state reads on a monochrome panel and
for people who do not tell red from green: a ring with a plus (not in a fleet), a dot (idle),
a down arrow (fetching its shard), a play triangle (serving), two bars (paused), an
exclamation mark (error), three dots (starting).
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QIcon, QPainter, QPen, QPixmap, QPolygonF

ICON_SIZES = (16, 22, 24, 32, 48, 64)
_CANVAS = 64.0  # glyphs are drawn in a 64x64 box and scaled


@dataclass(frozen=True)
class IconStyle:
    colour: str
    glyph: str
    filled: bool = True


STATE_STYLES: dict[str, IconStyle] = {
    "not-joined": IconStyle("#7b8190", "plus", filled=False),
    "starting": IconStyle("#7b8190", "dots"),
    "idle": IconStyle("#2f6fde", "dot"),
    "fetching": IconStyle("#0e8f9c", "arrow"),
    "serving": IconStyle("#1d9a49", "play"),
    "paused": IconStyle("#d99400", "pause"),
    "error": IconStyle("#d0312d", "bang"),
}


def _glyph(p: QPainter, glyph: str, colour: QColor) -> None:
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(colour)
    if glyph == "dot":
        p.drawEllipse(QPointF(32, 32), 9, 9)
    elif glyph == "plus":
        p.drawRoundedRect(QRectF(28, 17, 8, 30), 2, 2)
        p.drawRoundedRect(QRectF(17, 28, 30, 8), 2, 2)
    elif glyph == "arrow":
        p.drawRect(QRectF(28, 15, 8, 18))
        p.drawPolygon(QPolygonF([QPointF(18, 31), QPointF(46, 31), QPointF(32, 47)]))
        p.drawRect(QRectF(18, 47, 28, 4))
    elif glyph == "play":
        p.drawPolygon(QPolygonF([QPointF(25, 17), QPointF(48, 32), QPointF(25, 47)]))
    elif glyph == "pause":
        p.drawRoundedRect(QRectF(21, 18, 8, 28), 2, 2)
        p.drawRoundedRect(QRectF(35, 18, 8, 28), 2, 2)
    elif glyph == "bang":
        p.drawRoundedRect(QRectF(28, 14, 8, 24), 3, 3)
        p.drawEllipse(QPointF(32, 46), 4.5, 4.5)
    elif glyph == "dots":
        for x in (19, 32, 45):
            p.drawEllipse(QPointF(x, 32), 5, 5)
    else:  # an unknown glyph is a programming error, but an icon must still appear
        p.drawEllipse(QPointF(32, 32), 4, 4)


def state_pixmap(state: str, size: int = 64) -> QPixmap:
    """The icon for ``state`` (an AgentStatus state, or "starting") as a square pixmap."""
    style = STATE_STYLES.get(state, STATE_STYLES["error"])
    colour = QColor(style.colour)
    pixmap = QPixmap(size, size)
    pixmap.fill(Qt.GlobalColor.transparent)
    p = QPainter(pixmap)
    try:
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        p.scale(size / _CANVAS, size / _CANVAS)
        if style.filled:
            p.setPen(QPen(colour.darker(130), 3))
            p.setBrush(colour)
            p.drawEllipse(QPointF(32, 32), 29, 29)
            _glyph(p, style.glyph, QColor("white"))
        else:
            p.setPen(QPen(colour, 6))
            p.setBrush(Qt.BrushStyle.NoBrush)
            p.drawEllipse(QPointF(32, 32), 27, 27)
            _glyph(p, style.glyph, colour)
    finally:
        p.end()
    return pixmap


_cache: dict[str, QIcon] = {}


def state_icon(state: str) -> QIcon:
    """The icon for ``state`` at every size a tray asks for (built once per state)."""
    if state not in _cache:
        icon = QIcon()
        for size in ICON_SIZES:
            icon.addPixmap(state_pixmap(state, size))
        _cache[state] = icon
    return _cache[state]
