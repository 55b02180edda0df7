"""The Keys page: the fleet's OpenAI-compatible API for the people and programs that use it. Its
address, the console's own key (masked, with Show and Copy), a curl and a Python snippet with the
real address, key and model id; the API keys (issue one with limits, its secret shown once with
Copy; revoke with a confirmation) with each key's recent use from the API's audit log.

Every action is an admin API call through the bridge (``/admin/v1/keys``); the list follows the
service's ``keys`` events, so another console's or the command line's changes show here too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from PySide6.QtGui import QGuiApplication, QShowEvent
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from console.fleet_api.feed import Event, EventKind
from console.qt.api_snippets import curl_snippet, mask_key, python_snippet
from console.qt.confirm import ask_first
from console.qt.service_bridge import ServiceBridge
from console.qt.service_serving import ServiceServing

log = logging.getLogger("deskfleet.console")

COLUMNS = ("Name", "Requests/min", "Tokens/min", "Reads /metrics", "Issued", "Last used", "Requests", "Tokens")
CONSOLE_KEY = "console"


class QtKeysPage(QWidget):
    """``model_id()``: the model id the snippets name (the served one, else the chosen one)."""

    def __init__(self, bridge: ServiceBridge, serving: ServiceServing, model_id: Callable[[], str],
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.bridge, self.serving, self._model_id = bridge, serving, model_id
        self.keys: list[dict[str, Any]] = []
        self.usage: dict[str, dict[str, Any]] = {}
        self.snippet_key: tuple[str, str] | None = None  # (name, secret) the snippets use; None: the console's
        self.confirmation: QMessageBox | None = None
        self._build()
        bridge.started.connect(self.reload)
        bridge.service_event.connect(self._on_event)
        serving.api_ready.connect(lambda _: self.show_api())
        serving.api_key_known.connect(self.show_api)
        serving.phase_changed.connect(lambda _: self.show_api())
        self.show_api()

    def _build(self) -> None:
        api = QGroupBox("Use the fleet from programs (OpenAI-compatible API)")
        self.url_label = QLabel()
        self.url_label.setWordWrap(True)
        self.key_label = QLabel()
        self.show_key_button = QPushButton("Show")
        self.show_key_button.setCheckable(True)
        self.show_key_button.toggled.connect(lambda _: self.show_api())
        self.copy_key_button = QPushButton("Copy key")
        self.copy_key_button.clicked.connect(self.copy_console_key)
        key_row = QHBoxLayout()
        key_row.addWidget(QLabel("The console's own key:"))
        key_row.addWidget(self.key_label, 1)
        key_row.addWidget(self.show_key_button)
        key_row.addWidget(self.copy_key_button)
        self.snippets = QTabWidget()
        self.curl_view, self.python_view = QPlainTextEdit(), QPlainTextEdit()
        for view, title in ((self.curl_view, "curl"), (self.python_view, "Python (openai)")):
            view.setReadOnly(True)
            view.setMaximumHeight(110)
            self.snippets.addTab(view, title)
        self.snippets.setMaximumHeight(150)
        self.copy_snippet_button = QPushButton("Copy snippet")
        self.copy_snippet_button.clicked.connect(self.copy_snippet)
        self.snippet_note = QLabel()
        self.snippet_note.setWordWrap(True)
        snippet_row = QHBoxLayout()
        snippet_row.addWidget(self.snippet_note, 1)
        snippet_row.addWidget(self.copy_snippet_button)
        api_box = QVBoxLayout(api)
        api_box.addWidget(self.url_label)
        api_box.addLayout(key_row)
        api_box.addWidget(self.snippets)
        api_box.addLayout(snippet_row)

        keys = QGroupBox("API keys: one per person or program; revoke one and the API refuses it at once")
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.name_edit = QLineEdit()
        self.name_edit.setPlaceholderText("who holds it: alice, wiki-bot")
        self.name_edit.textChanged.connect(lambda _: self._update_buttons())
        self.name_edit.returnPressed.connect(self.issue)
        self.rpm = QSpinBox()
        self.tpm = QSpinBox()
        for limit, unit in ((self.rpm, " requests/min"), (self.tpm, " tokens/min")):
            limit.setRange(0, 10_000_000)
            limit.setSpecialValueText("no limit")
            limit.setSuffix(unit)
        self.metrics_check = QCheckBox("may read /metrics")
        self.issue_button = QPushButton("Issue key")
        self.issue_button.clicked.connect(self.issue)
        self.revoke_button = QPushButton("Revoke…")
        self.revoke_button.clicked.connect(self.revoke_selected)
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.clicked.connect(self.reload)
        issue_row = QHBoxLayout()
        issue_row.addWidget(self.name_edit, 1)
        for w in (self.rpm, self.tpm, self.metrics_check, self.issue_button):
            issue_row.addWidget(w)
        self.secret_edit = QLineEdit()
        self.secret_edit.setReadOnly(True)
        self.copy_secret_button = QPushButton("Copy")
        self.copy_secret_button.clicked.connect(lambda: self._copy(self.secret_edit.text(), "The new key"))
        self.secret_note = QLabel()
        self.secret_note.setWordWrap(True)
        self.secret_box = QWidget()
        secret_row = QHBoxLayout(self.secret_box)
        secret_row.setContentsMargins(0, 0, 0, 0)
        secret_row.addWidget(self.secret_note)
        secret_row.addWidget(self.secret_edit, 1)
        secret_row.addWidget(self.copy_secret_button)
        self.secret_box.hide()
        actions = QHBoxLayout()
        actions.addWidget(self.revoke_button)
        actions.addStretch(1)
        actions.addWidget(self.refresh_button)
        keys_box = QVBoxLayout(keys)
        keys_box.addWidget(self.table, 1)
        keys_box.addLayout(actions)
        keys_box.addLayout(issue_row)
        keys_box.addWidget(self.secret_box)
        self.message = QLabel()
        self.message.setWordWrap(True)
        box = QVBoxLayout(self)
        box.addWidget(api)
        box.addWidget(keys, 1)
        box.addWidget(self.message)
        self._update_buttons()

    def showEvent(self, event: QShowEvent) -> None:  # noqa: N802 (Qt's name)
        """Each visit reads the keys' use again (requests make no event)."""
        super().showEvent(event)
        self.reload()

    # ---- the API and its snippets ----------------------------------------------------------------

    def api_url(self) -> str:
        return str(self.serving.api_url or self.bridge.service.get("api_url") or "")

    def show_api(self) -> None:
        url, key = self.api_url(), self.serving.api_key or ""
        serving = self.serving.api_url is not None
        self.url_label.setText(f"Address: {url or 'not known yet'}" + ("" if serving else
                               " — no model is served yet: the API answers once one is (Dashboard: Get started)"))
        self.key_label.setText(key if self.show_key_button.isChecked() else mask_key(key) if key else "—")
        self.copy_key_button.setEnabled(bool(key))
        name, secret = self.snippet_key or (CONSOLE_KEY, key)
        model = self._model_id() or "MODEL"
        self.curl_view.setPlainText(curl_snippet(url or "http://HOST:8000/v1", secret or "KEY", model))
        self.python_view.setPlainText(python_snippet(url or "http://HOST:8000/v1", secret or "KEY", model))
        self.snippet_note.setText(f"The snippets use the key “{name}” and the model “{model}”. Give each person or "
                                  "program a key of its own (below) rather than the console's.")

    def copy_console_key(self) -> None:
        self._copy(self.serving.api_key or "", "The console's key")

    def copy_snippet(self) -> None:
        view = self.snippets.currentWidget()
        if isinstance(view, QPlainTextEdit):
            self._copy(view.toPlainText(), f"The {self.snippets.tabText(self.snippets.currentIndex())} snippet")

    def _copy(self, text: str, what: str) -> None:
        QGuiApplication.clipboard().setText(text)
        self._say(f"{what} is on the clipboard.")

    # ---- the keys --------------------------------------------------------------------------------

    def reload(self) -> None:
        """Read the keys and their recent use from the service."""
        if not self.bridge.running:
            return
        client = self.bridge.client

        async def read() -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
            keys = await client.async_keys()
            try:
                usage = await client.async_key_usage()
            except Exception as exc:  # an older service: the keys without their use
                log.info("no key usage from the service: %s", exc)
                usage = {}
            return keys, usage

        self.bridge.call(read(), "reading the API keys", on_result=self._show_keys,
                         on_error=lambda exc: self._say(f"Could not read the API keys: {exc}", error=True))

    def _on_event(self, event: Event) -> None:
        if event.kind is EventKind.KEYS:
            self.reload()
        elif event.kind is EventKind.RING:
            self.show_api()  # the model id the snippets name

    def _show_keys(self, result: tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]) -> None:
        self.keys, self.usage = result
        self.table.setRowCount(len(self.keys))
        for row, key in enumerate(self.keys):
            for col, text in enumerate(key_cells(key, self.usage.get(str(key.get("name"))))):
                self.table.setItem(row, col, QTableWidgetItem(text))
        self._update_buttons()

    def selected_name(self) -> str | None:
        rows = {i.row() for i in self.table.selectedItems()}
        return str(self.keys[min(rows)]["name"]) if rows and min(rows) < len(self.keys) else None

    def issue(self) -> None:
        name = self.name_edit.text().strip()
        if not name or not self.bridge.running:
            return
        rpm, tpm = self.rpm.value() or None, self.tpm.value() or None

        def issued(answer: Mapping[str, Any]) -> None:
            secret = str(answer["secret"])
            self.snippet_key = (name, secret)
            self.secret_edit.setText(secret)
            self.secret_note.setText(f"Key “{name}” — copy it now, it is shown only this once:")
            self.secret_box.show()
            self.name_edit.clear()
            self.show_api()
            self._say(f"Issued the key “{name}”. Its holder sends it as 'Authorization: Bearer <key>'.")

        self.bridge.call(self.bridge.client.async_issue_key(name, rpm=rpm, tpm=tpm,
                                                            metrics=self.metrics_check.isChecked()),
                         f"issuing the key {name}", on_result=issued,
                         on_error=lambda exc: self._say(f"Could not issue the key “{name}”: {exc}", error=True))

    def revoke_selected(self) -> None:
        """Ask first: whoever holds the key loses the API at once."""
        name = self.selected_name()
        if name is None:
            return
        self.confirmation = ask_first(
            self, "Revoke the key", f"Revoke the key “{name}”?",
            "Whoever uses it is refused from their next request; a revoked key cannot be restored (issue a new one).",
            lambda: self.bridge.call(self.bridge.client.async_revoke_key(name), f"revoking the key {name}",
                                     on_result=lambda _: self._revoked(name),
                                     on_error=lambda exc: self._say(f"Could not revoke “{name}”: {exc}", error=True)),
            closed=lambda: setattr(self, "confirmation", None))

    def _revoked(self, name: str) -> None:
        if self.snippet_key is not None and self.snippet_key[0] == name:
            self.snippet_key = None
            self.secret_box.hide()
            self.show_api()
        self._say(f"Revoked the key “{name}”.")

    def _update_buttons(self) -> None:
        self.issue_button.setEnabled(bool(self.name_edit.text().strip()))
        name = self.selected_name()
        self.revoke_button.setEnabled(name is not None and name != CONSOLE_KEY)
        self.revoke_button.setToolTip("the console's own key is the console's chat's; it is not revoked here"
                                      if name == CONSOLE_KEY else "")

    def _say(self, text: str, error: bool = False) -> None:
        self.message.setStyleSheet("color: #b3261e;" if error else "")
        self.message.setText(text)


def key_cells(key: Mapping[str, Any], use: Mapping[str, Any] | None) -> tuple[str, ...]:
    """A key's row: name, limits, /metrics, issued, and its recent use ("—" where there is none)."""
    return (str(key.get("name", "")), str(key.get("rpm") or "no limit"), str(key.get("tpm") or "no limit"),
            "yes" if key.get("metrics") else "no", str(key.get("issued_at", ""))[:19].replace("T", " "),
            str(use["last"])[:19].replace("T", " ") if use else "never (in the recent log)",
            str(use["requests"]) if use else "0", str(use["tokens"]) if use else "0")
