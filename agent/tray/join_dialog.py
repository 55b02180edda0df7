"""The agent's first-run window ("Join a fleet…"): the join token, then "waiting for approval".

Page one says what the app will do with the PC and asks for the token only; the console is
searched for on the network as the window opens, and the address field appears only when none
answered or the person asks for it. A mistyped token, a refused one or an unreachable console
is explained in the window (the messages come from :mod:`engine.control.enrollment` and say what to
do), and nothing about the agent changes. Page two follows the join: waiting for the admin to
approve the PC, then approved once the console gives it work. Texts come from
:mod:`agent.tray.first_run_model`.
"""

from __future__ import annotations

from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from agent.tray import first_run_model as model
from agent.tray.bridge import AgentBridge
from engine.control.messages import AgentStatus
from engine.trust.fleet_ca import Credentials


def _wrapped(text: str = "") -> QLabel:
    label = QLabel(text)
    label.setWordWrap(True)
    return label


class JoinDialog(QDialog):
    def __init__(self, bridge: AgentBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.credentials: Credentials | None = None
        self.consoles = None  # None while searching; then the tuple the search found
        self.setWindowTitle("Welcome to Deskfleet")
        self.setMinimumWidth(540)

        self.what_it_does = _wrapped(model.WHAT_IT_DOES)
        self.pages = QStackedWidget()
        self.pages.addWidget(self._token_page())
        self.pages.addWidget(self._waiting_page())
        box = QVBoxLayout(self)
        box.addWidget(self.what_it_does)
        box.addWidget(self.pages)
        bridge.status_changed.connect(self._status_changed)
        self._refresh_address()

    def _token_page(self) -> QWidget:
        page = QWidget()
        self.token_edit = QLineEdit()
        self.token_edit.setPlaceholderText("DFJ1-…")
        self.console_edit = QLineEdit()
        self.console_edit.setPlaceholderText("host:port, e.g. 192.168.1.10:7411")
        self.consoles_label = _wrapped(model.SEARCHING)
        self.address_button = QPushButton("Enter the console's address…")
        self.address_button.setFlat(True)
        self.address_button.clicked.connect(self._ask_address)
        self._address_asked = False
        self.form = QFormLayout()
        self.form.addRow("Join token:", self.token_edit)
        self.form.addRow("Console address:", self.console_edit)
        self.message = _wrapped()
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.join_button = self.buttons.addButton("Join", QDialogButtonBox.ButtonRole.AcceptRole)
        self.buttons.accepted.connect(self.submit)
        self.buttons.rejected.connect(self.reject)
        box = QVBoxLayout(page)
        box.addWidget(_wrapped(model.TOKEN_PROMPT))
        box.addLayout(self.form)
        box.addWidget(self.consoles_label)
        box.addWidget(self.address_button)
        box.addWidget(self.message)
        box.addWidget(self.buttons)
        return page

    def _waiting_page(self) -> QWidget:
        page = QWidget()
        self.waiting_headline = QLabel()
        font = self.waiting_headline.font()
        font.setBold(True)
        font.setPointSizeF(font.pointSizeF() * 1.2)
        self.waiting_headline.setFont(font)
        self.waiting_detail = _wrapped()
        close = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        close.rejected.connect(self.accept)
        self.close_button = close.button(QDialogButtonBox.StandardButton.Close)
        box = QVBoxLayout(page)
        box.addWidget(self.waiting_headline)
        box.addWidget(self.waiting_detail)
        box.addStretch(1)
        box.addWidget(close)
        return page

    # ---- the console search --------------------------------------------------------------------

    def showEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        super().showEvent(event)
        if self.consoles is None and not getattr(self, "_searching", False):
            self.search()

    def search(self) -> None:
        self._searching = True
        self.bridge.find_consoles(on_result=self._found, on_error=lambda _e: self._found(()))

    def _found(self, consoles) -> None:
        self._searching = False
        self.consoles = tuple(consoles)
        self.consoles_label.setText(model.consoles_line(self.consoles))
        self._refresh_address()

    def _ask_address(self) -> None:
        self._address_asked = True
        self._refresh_address()
        self.console_edit.setFocus()

    def _refresh_address(self) -> None:
        show = model.show_address_field(self.consoles, self._address_asked)
        self.form.setRowVisible(self.console_edit, show)
        self.address_button.setVisible(not show)

    # ---- joining -------------------------------------------------------------------------------

    @property
    def page(self) -> str:
        return "token" if self.pages.currentIndex() == 0 else "waiting"

    @property
    def busy(self) -> bool:
        return not self.join_button.isEnabled()

    def submit(self) -> None:
        request = model.join_request(self.token_edit.text(), self.console_edit.text())
        if isinstance(request, str):
            self._show(request, error=True)
            return
        token, console = request
        self._set_busy(True)
        self._show(f"Joining the fleet at {console}…" if console else
                   "Finding your fleet's console and joining…", error=False)
        self.bridge.join(console, token, on_result=self._joined, on_error=self._failed)

    def _joined(self, credentials: Credentials) -> None:
        self.credentials = credentials
        self._set_busy(False)
        self._show("", error=False)
        self.pages.setCurrentIndex(1)
        self._status_changed(self.bridge.status)

    def _status_changed(self, status: AgentStatus | None) -> None:
        if self.page != "waiting":
            return
        waiting = model.waiting_page(status)
        self.waiting_headline.setText(waiting.headline)
        self.waiting_detail.setText(waiting.detail)

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
