"""The "Join a fleet…" dialog: the one-time join token and the console's address, as the console shows them.

The dialog stays open until the join succeeds: a mistyped token, a refused one or an
unreachable console is explained inside it (the messages come from
:mod:`engine.enrollment` and say what to do), and nothing about the agent changes.
"""

from __future__ import annotations

from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QVBoxLayout,
    QWidget,
)

from agent.tray.bridge import AgentBridge
from engine.trust import Credentials


class JoinDialog(QDialog):
    def __init__(self, bridge: AgentBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.credentials: Credentials | None = None
        self.setWindowTitle("Join a Deskfleet fleet")
        self.setMinimumWidth(520)

        intro = QLabel("Ask your admin for a join token. The console shows it together with its "
                       "address; a token admits one PC, once.")
        intro.setWordWrap(True)
        self.token_edit = QLineEdit()
        self.token_edit.setPlaceholderText("DFJ1-…")
        self.console_edit = QLineEdit()
        self.console_edit.setPlaceholderText("host:port, e.g. 192.168.1.10:7411")
        form = QFormLayout()
        form.addRow("Join token:", self.token_edit)
        form.addRow("Console address:", self.console_edit)

        self.message = QLabel()
        self.message.setWordWrap(True)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.join_button = self.buttons.addButton("Join", QDialogButtonBox.ButtonRole.AcceptRole)
        self.buttons.accepted.connect(self.submit)
        self.buttons.rejected.connect(self.reject)

        box = QVBoxLayout(self)
        box.addWidget(intro)
        box.addLayout(form)
        box.addWidget(self.message)
        box.addWidget(self.buttons)

    @property
    def busy(self) -> bool:
        return not self.join_button.isEnabled()

    def submit(self) -> None:
        token, console = self.token_edit.text().strip(), self.console_edit.text().strip()
        if not token or not console:
            self._show("Enter both the join token and the console address.", error=True)
            return
        self._set_busy(True)
        self._show(f"Joining the fleet at {console}…", error=False)
        self.bridge.join(console, token, on_result=self._joined, on_error=self._failed)

    def _joined(self, credentials: Credentials) -> None:
        self.credentials = credentials
        self._set_busy(False)
        self.accept()

    def _failed(self, error: BaseException) -> None:
        self._set_busy(False)
        self._show(f"Could not join: {error}", error=True)

    def _set_busy(self, busy: bool) -> None:
        self.join_button.setEnabled(not busy)
        self.token_edit.setEnabled(not busy)
        self.console_edit.setEnabled(not busy)

    def _show(self, text: str, *, error: bool) -> None:
        self.message.setStyleSheet("color: #b3261e;" if error else "")
        self.message.setText(text)

    @property
    def error_text(self) -> str:
        return self.message.text() if self.message.styleSheet() else ""
