"""The Dashboard's "Get started" checklist (what it says: :mod:`console.qt.first_steps`): a row per
step with a tick, its text, a link to the page that does it by hand and, where one press does it,
a button (Copy the token, Approve all, Serve the default model, Open Chat). It hides itself while
the fleet serves a model that has answered.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt
from PySide6.QtGui import QFont, QGuiApplication
from PySide6.QtWidgets import QGridLayout, QGroupBox, QLabel, QPushButton, QWidget

from console.qt.first_steps import PAGES, FleetNow, Step, StepKey, checklist
from console.qt.quick_serve import QuickServe

DONE, TODO = "✔", "○"


class QtFirstSteps(QGroupBox):
    """``now()`` gives the fleet's state; ``show_page(title)`` opens a tab; ``approve_all()`` approves
    every waiting PC."""

    def __init__(self, now: Callable[[], FleetNow], quick: QuickServe, show_page: Callable[[str], None],
                 approve_all: Callable[[], None], parent: QWidget | None = None) -> None:
        super().__init__("Get started: from an empty fleet to a served model", parent)
        self._now, self.quick, self._show_page = now, quick, show_page
        self.steps: tuple[Step, ...] = ()
        self.ticks: dict[StepKey, QLabel] = {}
        self.titles: dict[StepKey, QLabel] = {}
        self.details: dict[StepKey, QLabel] = {}
        self.links: dict[StepKey, QPushButton] = {}
        self.buttons: dict[StepKey, QPushButton] = {}
        grid = QGridLayout(self)
        grid.setColumnStretch(2, 1)
        act: dict[StepKey, tuple[str, Callable[[], None]]] = {
            StepKey.JOIN: ("Copy token", self.copy_token), StepKey.APPROVE: ("Approve all", approve_all),
            StepKey.SERVE: ("Serve it", quick.start), StepKey.CHAT: ("Open Chat", lambda: show_page("Chat"))}
        big = QFont(self.font())
        big.setPointSizeF(self.font().pointSizeF() * 1.4)
        for row, key in enumerate(StepKey):
            tick, title, detail = QLabel(TODO), QLabel(), QLabel()
            tick.setFont(big)
            bold = QFont(self.font())
            bold.setBold(True)
            title.setFont(bold)
            detail.setWordWrap(True)
            detail.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            link = QPushButton(f"{PAGES[key]} page →")
            link.setFlat(True)
            link.clicked.connect(lambda _=False, page=PAGES[key]: show_page(page))
            link.setStyleSheet("color: #1a73e8; text-decoration: underline;")
            label, fn = act[key]
            action = QPushButton(label)
            action.clicked.connect(fn)
            for col, widget in enumerate((tick, title, detail, action, link)):
                grid.addWidget(widget, row, col, Qt.AlignmentFlag.AlignTop)
            self.ticks[key], self.titles[key], self.details[key] = tick, title, detail
            self.links[key], self.buttons[key] = link, action
        quick.changed.connect(self.refresh)
        self.refresh()

    def step(self, key: StepKey) -> Step:
        return next(s for s in self.steps if s.key is key)

    def copy_token(self) -> None:
        QGuiApplication.clipboard().setText(self._now().token)
        self.buttons[StepKey.JOIN].setText("Copied")

    def refresh(self, *_: object) -> None:
        now = self._now()
        self.steps = checklist(now)
        for s in self.steps:
            self.ticks[s.key].setText(DONE if s.done else TODO)
            self.ticks[s.key].setStyleSheet("color: #1e8e3e;" if s.done else "color: #5f6368;")
            self.titles[s.key].setText(s.title)
            detail = s.detail
            if s.key is StepKey.SERVE and self.quick.text and not s.done:
                detail = self.quick.text
            self.details[s.key].setText(detail)
            self.details[s.key].setStyleSheet("color: #b3261e;" if s.key is StepKey.SERVE and self.quick.error
                                              and not s.done else "")
            button = self.buttons[s.key]
            if s.key is StepKey.JOIN:
                button.setEnabled(bool(now.token))
            else:
                button.setEnabled(s.can_act)
            button.setVisible(not s.done)
        # the Dashboard's empty state: gone once the fleet serves and has answered (a PC joining
        # later is the approval banner's business, not a reason to push the fleet's figures down)
        done = {s.key: s.done for s in self.steps}
        self.setVisible(not (done[StepKey.SERVE] and done[StepKey.CHAT]))
