"""The console's Join tokens dialog: the fleet's tokens with uses / used / expiry / auto-approve /
label and whom each admitted, an Issue form (uses, expiry, auto-approve, label), Revoke, and the
new token's text with a Copy button (shown once: the service keeps only its hash).

``QtTokensDialog(bridge, parent)`` calls the admin API through ``bridge.call`` (off the GUI
thread) and refreshes on the service's ``tokens`` events. The rows and the form's rules are pure
(:mod:`console.fleet_api.token_rows`).
"""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from console.fleet_api.token_rows import COLUMNS, EXPIRY_CHOICES, TokenFormError, TokenRow, issue_options, token_rows

MAX_USES = 100_000


class QtTokensDialog(QDialog):
    """See the module docstring. ``bridge`` is the console's ServiceBridge (or anything with
    ``call``, ``client`` and a ``service_event`` signal)."""

    def __init__(self, bridge: Any, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.bridge = bridge
        self.rows: tuple[TokenRow, ...] = ()
        self.setWindowTitle("Join tokens")
        self.resize(1000, 560)

        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setStretchLastSection(True)
        self.table.itemSelectionChanged.connect(self._selection_changed)

        self.revoke_button = QPushButton("Revoke")
        self.revoke_button.setToolTip("Stop the selected token admitting PCs (the PCs it admitted stay)")
        self.revoke_button.setEnabled(False)
        self.revoke_button.clicked.connect(self.revoke_selected)
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.clicked.connect(self.refresh)
        actions = QHBoxLayout()
        actions.addWidget(self.revoke_button)
        actions.addStretch(1)
        actions.addWidget(self.refresh_button)

        self.uses = QSpinBox()
        self.uses.setRange(1, MAX_USES)
        self.uses.setToolTip("How many PCs this token admits (1: a single PC)")
        self.expiry = QComboBox()
        for text, _ in EXPIRY_CHOICES:
            self.expiry.addItem(text)
        self.auto_approve = QCheckBox("Approve the PCs it admits (the token must expire)")
        self.label_edit = QLineEdit()
        self.label_edit.setPlaceholderText("e.g. floor 3 roll-out")
        self.label_edit.setMaxLength(80)
        self.issue_button = QPushButton("Issue…")
        self.issue_button.clicked.connect(self.issue)
        self.label_edit.setMinimumWidth(320)
        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.FieldsStayAtSizeHint)
        form.addRow("Uses", self.uses)
        form.addRow("Expires after", self.expiry)
        form.addRow("", self.auto_approve)
        form.addRow("Label", self.label_edit)
        form.addRow("", self.issue_button)
        issue_box = QGroupBox("Issue a token")
        issue_box.setLayout(form)

        self.token_edit = QLineEdit()
        self.token_edit.setReadOnly(True)
        self.token_edit.setPlaceholderText("the new token appears here, once")
        self.copy_button = QPushButton("Copy")
        self.copy_button.setEnabled(False)
        self.copy_button.clicked.connect(self.copy_token)
        token_line = QHBoxLayout()
        token_line.addWidget(self.token_edit, 1)
        token_line.addWidget(self.copy_button)
        self.status = QLabel("")
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        layout = QVBoxLayout(self)
        layout.addWidget(self.table, 1)
        layout.addLayout(actions)
        layout.addWidget(issue_box)
        layout.addLayout(token_line)
        layout.addWidget(self.status)

        signal = getattr(bridge, "service_event", None)
        if signal is not None:
            signal.connect(self._on_service_event)
        self.refresh()

    # ---- the list -------------------------------------------------------------------------------

    def refresh(self) -> None:
        self.bridge.call(self.bridge.client.async_tokens(), "listing the join tokens",
                         on_result=self.show_tokens, on_error=self._failed)

    def show_tokens(self, tokens: list[dict[str, Any]]) -> None:
        selected = self.selected_id()
        self.rows = token_rows(tokens, time.time())
        self.table.setRowCount(len(self.rows))
        for r, row in enumerate(self.rows):
            for c, text in enumerate(row.cells):
                item = QTableWidgetItem(text)
                if not row.active:
                    item.setForeground(Qt.GlobalColor.gray)
                self.table.setItem(r, c, item)
            if row.token_id == selected:
                self.table.selectRow(r)
        self._selection_changed()

    def selected_id(self) -> str | None:
        rows = {i.row() for i in self.table.selectedItems()}
        return self.rows[rows.pop()].token_id if len(rows) == 1 and max(rows) < len(self.rows) else None

    def _selection_changed(self) -> None:
        token_id = self.selected_id()
        self.revoke_button.setEnabled(any(r.token_id == token_id and r.active for r in self.rows))

    def _on_service_event(self, event: Any) -> None:
        if getattr(event, "kind", None) == "tokens" and isinstance(event.data, dict):
            self.show_tokens(list(event.data.get("tokens", [])))

    # ---- actions --------------------------------------------------------------------------------

    def issue(self) -> None:
        try:
            options = issue_options(self.uses.value(), self.expiry.currentIndex(), self.auto_approve.isChecked(),
                                    self.label_edit.text())
        except TokenFormError as exc:
            self.status.setText(str(exc))
            return
        self.issue_button.setEnabled(False)
        self.status.setText("issuing …")
        self.bridge.call(self.bridge.client.async_issue_token(**options), "issuing a join token",
                         on_result=self._issued, on_error=self._failed)

    def _issued(self, answer: dict[str, Any]) -> None:
        self.issue_button.setEnabled(True)
        info = answer.get("token_info", {})
        self.token_edit.setText(str(answer["token"]))
        self.copy_button.setEnabled(True)
        what = f"{info.get('uses', 1)} use(s)" + (", auto-approving" if info.get("auto_approve") else "")
        self.status.setText(f"Issued token {info.get('id', '?')} ({what}). Copy it now: the service keeps only "
                            "its hash, so it is shown this once.")
        self.refresh()

    def copy_token(self) -> None:
        QGuiApplication.clipboard().setText(self.token_edit.text())
        self.status.setText("Token copied to the clipboard.")

    def revoke_selected(self) -> None:
        token_id = self.selected_id()
        if token_id is None:
            return
        row = next(r for r in self.rows if r.token_id == token_id)
        if not self.confirm_revoke(row):
            return
        self.bridge.call(self.bridge.client.async_revoke_token(token_id), "revoking a join token",
                         on_result=lambda info: self._revoked(token_id), on_error=self._failed)

    def confirm_revoke(self, row: TokenRow) -> bool:
        """Ask before revoking (a revoked token cannot be brought back)."""
        answer = QMessageBox.question(
            self, "Revoke the join token?",
            f"Revoke token {row.cells[0]} ({row.token_id})? It admits no PC from now on; the PCs it admitted stay.")
        return answer == QMessageBox.StandardButton.Yes

    def _revoked(self, token_id: str) -> None:
        self.status.setText(f"Token {token_id} revoked.")
        self.refresh()

    def _failed(self, exc: BaseException) -> None:
        self.issue_button.setEnabled(True)
        self.status.setText(f"The service refused: {exc}")
