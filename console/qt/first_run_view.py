"""The console's first-run view: the fleet is created; here is the join token, to copy or scan.

A standalone widget for the console window to embed (for instance as the Fleet page's empty
state, or a dialog on the first start: ``engine.control.fleet_services.is_first_run(state_dir)`` tells, before
the fleet host starts, whether this start creates the fleet). It needs three things from its
host: the fleet id, the enrollment address, and ``issue_token()`` returning a new join token
(``FleetHost.token``; called on the GUI thread, so pass a function that is safe there).
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QColor, QFontDatabase, QGuiApplication, QPainter
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from console.qt.first_run_model import NO_QR, QUIET_ZONE, first_run_text, qr_matrix


class QtQrCode(QWidget):
    """Paints a QR matrix: square modules, black on white, with the quiet zone."""

    def __init__(self, parent: QWidget | None = None, module_px: int = 5) -> None:
        super().__init__(parent)
        self.matrix: tuple[tuple[bool, ...], ...] = ()
        self.module_px = module_px
        self.setSizePolicy(QSizePolicy.Policy.Fixed, QSizePolicy.Policy.Fixed)

    def set_matrix(self, matrix: tuple[tuple[bool, ...], ...]) -> None:
        self.matrix = matrix
        side = (len(matrix) + 2 * QUIET_ZONE) * self.module_px
        self.setFixedSize(side, side)
        self.update()

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt's name)
        side = (len(self.matrix) + 2 * QUIET_ZONE) * self.module_px
        return QSize(side, side)

    def module_rect_center(self, row: int, col: int) -> tuple[int, int]:
        """Pixel centre of module (row, col): what a test samples."""
        return ((col + QUIET_ZONE) * self.module_px + self.module_px // 2,
                (row + QUIET_ZONE) * self.module_px + self.module_px // 2)

    def paintEvent(self, _event) -> None:  # noqa: N802
        p = QPainter(self)
        p.fillRect(self.rect(), QColor("white"))
        m = self.module_px
        for r, row in enumerate(self.matrix):
            for c, dark in enumerate(row):
                if dark:
                    p.fillRect((c + QUIET_ZONE) * m, (r + QUIET_ZONE) * m, m, m, QColor("black"))
        p.end()


class QtFirstRunView(QWidget):
    """``token_issued(token)`` after each new token (the first one included)."""

    token_issued = Signal(str)

    def __init__(self, fleet_id: str, enrollment: str, issue_token: Callable[[], str],
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("deskfleet-first-run")
        self.issue_token = issue_token
        text = first_run_text(fleet_id, enrollment)

        headline = QLabel(text.headline)
        font = headline.font()
        font.setBold(True)
        font.setPointSizeF(font.pointSizeF() * 1.5)
        headline.setFont(font)
        labels = [QLabel(t) for t in (text.fleet, text.steps)]
        self.address_label = QLabel(text.address)
        self.address_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.token_edit = QLineEdit()
        self.token_edit.setReadOnly(True)
        self.token_edit.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.token_edit.setMinimumWidth(560)
        self.copy_button = QPushButton("Copy")
        self.copy_button.clicked.connect(self.copy)
        self.new_button = QPushButton("New token")
        self.new_button.clicked.connect(self.new_token)
        self.copied_label = QLabel()
        row = QHBoxLayout()
        row.addWidget(self.token_edit, 1)
        row.addWidget(self.copy_button)
        row.addWidget(self.new_button)

        self.qr = QtQrCode()
        self.qr_note = QLabel(NO_QR)

        box = QVBoxLayout(self)
        box.addWidget(headline)
        for label in (*labels, self.address_label):
            label.setWordWrap(True)
            box.addWidget(label)
        box.addLayout(row)
        box.addWidget(self.copied_label)
        box.addWidget(self.qr, 0, Qt.AlignmentFlag.AlignHCenter)
        box.addWidget(self.qr_note)
        box.addStretch(1)
        self.new_token()

    @property
    def token(self) -> str:
        return self.token_edit.text()

    def new_token(self) -> str:
        token = self.issue_token()
        self.token_edit.setText(token)
        self.copied_label.setText("")
        matrix = qr_matrix(token)
        self.qr.setVisible(matrix is not None)
        self.qr_note.setVisible(matrix is None)
        if matrix is not None:
            self.qr.set_matrix(matrix)
        self.token_issued.emit(token)
        return token

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.token)
        self.copied_label.setText("Copied. Paste it into the agent on the PC that should join.")
