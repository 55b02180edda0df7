"""The strips above the console's pages that say what needs the admin now, each with its way out:
the fleet service is out of reach (Retry), PCs wait for approval (Review · Approve all).

A banner is a coloured line of text with buttons; it hides itself when there is nothing to say.
What each says is decided here from the bridge's state, not by the pages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QWidget

from console.fleet_api.agent_record import AgentRecord
from console.qt.fleet_overview import awaiting_approval

WARNING, NOTICE = "#fce8e6", "#f3e8fd"  # the banners' backgrounds: trouble, a request


class QtBanner(QFrame):
    """A line of text and buttons (``label``, what pressing it does), hidden until ``say``."""

    def __init__(self, colour: str, buttons: Sequence[tuple[str, Callable[[], None]]],
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("banner")
        self.setStyleSheet(f"#banner {{ background: {colour}; border-radius: 4px; }}")
        self.text = QLabel()
        self.text.setWordWrap(True)
        self.buttons: dict[str, QPushButton] = {}
        row = QHBoxLayout(self)
        row.setContentsMargins(10, 6, 10, 6)
        row.addWidget(self.text, 1)
        for label, action in buttons:
            button = QPushButton(label)
            button.clicked.connect(action)
            row.addWidget(button)
            self.buttons[label] = button
        self.hide()

    def say(self, text: str | None) -> None:
        """Show ``text`` (None or "": hide)."""
        if text:
            self.text.setText(text)
        self.setVisible(bool(text))


def approval_text(records: Sequence[AgentRecord]) -> str | None:
    """ "3 PCs wait for approval", or None when none does."""
    n = len(awaiting_approval(records))
    if n == 0:
        return None
    return f"{n} PC{'s wait' if n != 1 else ' waits'} for approval: they joined with a token and do nothing " \
           "for the fleet until approved."


def lost_service_text(remote: str | None, retrying: bool) -> str:
    """What the banner says while the console's feed cannot reach the fleet service."""
    where = f"the fleet service at {remote}" if remote else "the fleet service on this PC"
    text = (f"Lost contact with {where}: what the pages show may be out of date. The console tries again every "
            "second")
    if retrying:
        return text + "; starting the service again…"
    return text + (". Is it running, and is the network up?" if remote else
                   ", or press Retry to start the service again.")
