"""The chat's input box: several lines (a pasted snippet keeps its lines), Enter sends and
Shift+Enter starts a new line, as chat windows do. It answers ``text()``/``setText()`` and emits
``returnPressed`` like the QLineEdit it replaces, so the shells and their tests drive it the same way."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QPlainTextEdit, QSizePolicy, QWidget

VISIBLE_LINES = 3


class QtChatInput(QPlainTextEdit):
    returnPressed = Signal()  # noqa: N815 (QLineEdit's name)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setTabChangesFocus(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        line = self.fontMetrics().lineSpacing()
        margins = self.contentsMargins()
        self.setFixedHeight(line * VISIBLE_LINES + int(self.document().documentMargin() * 2)
                            + margins.top() + margins.bottom() + 4)

    def text(self) -> str:
        return self.toPlainText()

    def setText(self, text: str) -> None:  # noqa: N802 (QLineEdit's name)
        self.setPlainText(text)

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 (Qt's name)
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.returnPressed.emit()
            return
        super().keyPressEvent(event)
