"""One question before anything that cannot be undone (revoking a key, removing PCs, stopping a
ring that serves): a warning box, Cancel by default, ``then()`` only on Yes. Non-modal (``open``),
so the page stays live and tests can answer it."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtWidgets import QMessageBox, QWidget


def ask_first(parent: QWidget, title: str, question: str, detail: str, then: Callable[[], object],
              closed: Callable[[], None] = lambda: None) -> QMessageBox:
    """Open the question; ``closed()`` when it is answered either way (before ``then()``)."""
    box = QMessageBox(QMessageBox.Icon.Warning, title, question,
                      QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel, parent)
    box.setInformativeText(detail)
    box.setDefaultButton(QMessageBox.StandardButton.Cancel)

    def answered(button) -> None:
        closed()
        if box.standardButton(button) == QMessageBox.StandardButton.Yes:
            then()

    box.buttonClicked.connect(answered)
    box.open()
    return box
