"""The tray icon and its menu: a thin view over :class:`agent.tray.bridge.AgentBridge`.

What each action shows (text, enabled, checked, visible) is decided by
:func:`agent.tray.tray_model.menu_state`; this class copies it onto the QActions whenever the
status changes, and turns clicks into bridge calls. Notifications go through
``QSystemTrayIcon.showMessage`` and are also kept in ``notices``, the record of what the person
was told (where no tray exists they would otherwise vanish).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QMenu, QMessageBox, QSystemTrayIcon

from agent.service import pause
from agent.tray import autostart
from agent.tray.bridge import AgentBridge
from agent.tray.icons import state_icon
from agent.tray.join_dialog import JoinDialog
from agent.tray.tray_model import (
    NO_CHAT_ADDRESS,
    NOT_JOINED_CHAT,
    STARTING,
    MenuState,
    Notice,
    PauseFor,
    TrayContext,
    menu_state,
    pause_until,
)
from engine.control.messages import AgentStatus

log = logging.getLogger(__name__)

NOTICE_MS = 8000
PAUSE_CHECK_MS = 30_000
_NOTICE_ICONS = {"info": QSystemTrayIcon.MessageIcon.Information,
                 "warning": QSystemTrayIcon.MessageIcon.Warning,
                 "error": QSystemTrayIcon.MessageIcon.Critical}


def ask_to_leave() -> bool:
    """The confirmation before "Leave fleet" deletes this PC's fleet certificate."""
    answer = QMessageBox.question(
        None, "Leave the fleet?",
        "This PC will stop serving and forget its fleet certificate. Joining again needs a new token "
        "from the admin.", QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
        QMessageBox.StandardButton.No)
    return answer == QMessageBox.StandardButton.Yes


class QtAgentTray(QObject):
    """``login_command``: what "Start at login" registers; ``confirm_leave``: asks the person."""

    quit_requested = Signal()

    def __init__(self, bridge: AgentBridge, login_command: Sequence[str], *,
                 confirm_leave: Callable[[], bool] = ask_to_leave, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("deskfleet-tray")
        self.bridge = bridge
        self.login_command = list(login_command)
        self.confirm_leave = confirm_leave
        self.notices: list[Notice] = []
        self.join_dialog: JoinDialog | None = None
        self.chat_window = None  # console.shared.chat_view.QtChatWindow, imported when first opened
        self.state = STARTING

        self.menu = QMenu()
        self.status_action = self._action("Starting…", enabled=False)
        self.menu.addSeparator()
        self.pause_action = self._action("Pause", self.toggle_pause)
        self.paused_until: dt.datetime | None = None  # the end of a timed pause of the person's
        self.timed_pause_actions = {choice: self._action(choice.value, lambda _=False, c=choice: self.pause_for(c))
                                    for choice in PauseFor}
        self._pause_clock = QTimer(self)  # ends a timed pause (a minute late at most)
        self._pause_clock.setInterval(PAUSE_CHECK_MS)
        self._pause_clock.timeout.connect(self.end_timed_pause_if_due)
        self.pause_in_use_action = self._action("Pause while I use this PC", self.set_pause_while_in_use,
                                                checkable=True)
        self.menu.addSeparator()
        self.chat_action = self._action("Open chat…", self.open_chat)
        self.join_action = self._action("Join a fleet…", self.open_join_dialog)
        self.leave_action = self._action("Leave fleet", self.leave)
        self.menu.addSeparator()
        self.login_action = self._action("Start at login", self.set_start_at_login, checkable=True)
        self.menu.addSeparator()
        self.quit_action = self._action("Quit Deskfleet", self.quit)

        self.icon = QSystemTrayIcon(state_icon(STARTING))
        self.icon.setContextMenu(self.menu)
        self.icon.activated.connect(self._activated)
        bridge.status_changed.connect(self.refresh)
        bridge.started.connect(self.refresh)  # actions enable once the service can take calls
        bridge.notice.connect(self.show_notice)
        self.refresh(None)

    def _action(self, text: str, slot: Callable | None = None, *, enabled: bool = True,
                checkable: bool = False) -> QAction:
        action = QAction(text, self.menu)
        action.setEnabled(enabled)
        action.setCheckable(checkable)
        if slot is not None:
            action.triggered.connect(slot)  # triggered: clicks only, not refresh()'s setChecked
        self.menu.addAction(action)
        return action

    def show(self) -> None:
        self.icon.show()

    # ---- status -> widgets -------------------------------------------------------------------------

    def current_menu_state(self) -> MenuState:
        try:
            login = autostart.is_enabled()
        except autostart.AutostartError:
            login = False
        context = TrayContext(dt.datetime.now(), self.bridge.parts, self.paused_until,
                              self.bridge.settings.resume_after_idle_s)
        return menu_state(self.bridge.status, self.bridge.settings, login, context)

    def refresh(self, status: AgentStatus | None = None) -> None:
        status = status if status is not None else self.bridge.status
        if self.paused_until is not None and status is not None and pause.MANUAL not in status.paused_reasons:
            self.paused_until = None  # resumed another way (the menu's Resume, the console): no timer left
            self._pause_clock.stop()
        m = self.current_menu_state()
        self.state = status.state if status is not None else STARTING
        if status is None and self.bridge.start_error is not None:
            m = replace(m, status=f"Error: could not start ({self.bridge.start_error})"[:90])
            self.state = "error"
        self.status_action.setText(m.status)
        self.pause_action.setText(m.pause_text)
        self.pause_action.setEnabled(m.pause_enabled and self.bridge.running)
        for action in self.timed_pause_actions.values():
            action.setEnabled(m.pause_enabled and self.bridge.running and self.paused_until is None)
        self.chat_action.setText("Open chat…" if status is not None and status.api_url else
                                 "Open chat… (not available yet)")
        self.pause_in_use_action.setChecked(m.pause_while_in_use)
        self.pause_in_use_action.setEnabled(self.bridge.running)
        self.join_action.setVisible(not m.joined)
        self.join_action.setEnabled(not m.joined and self.bridge.running)
        self.leave_action.setVisible(m.joined)
        self.leave_action.setEnabled(m.joined and self.bridge.running)
        self.login_action.setChecked(m.start_at_login)
        self.icon.setIcon(state_icon(self.state))
        self.icon.setToolTip(f"Deskfleet — {m.status}")

    def show_notice(self, notice: Notice) -> None:
        self.notices.append(notice)
        log.log(logging.WARNING if notice.level == "error" else logging.INFO, "%s: %s", notice.title, notice.message)
        self.icon.showMessage(notice.title, notice.message, _NOTICE_ICONS.get(notice.level,
                              QSystemTrayIcon.MessageIcon.Information), NOTICE_MS)

    # ---- actions -----------------------------------------------------------------------------------

    def _activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason == QSystemTrayIcon.ActivationReason.Trigger:  # a left click: what most people try first
            self.icon.contextMenu().popup(self.icon.geometry().center())

    def toggle_pause(self) -> None:
        paused = self.current_menu_state().manually_paused
        if paused:
            self.paused_until = None
            self._pause_clock.stop()
        self.bridge.set_manual_pause(not paused)

    def pause_for(self, choice: PauseFor, now: dt.datetime | None = None) -> None:
        """Pause now and resume by itself at the end (this tray keeps the time: quitting it ends the
        timer, not the pause)."""
        self.paused_until = pause_until(choice, now or dt.datetime.now())
        self._pause_clock.start()
        self.bridge.set_manual_pause(True, on_result=lambda _: self.refresh())

    def end_timed_pause_if_due(self, now: dt.datetime | None = None) -> None:
        if self.paused_until is not None and (now or dt.datetime.now()) >= self.paused_until:
            self.paused_until = None
            self._pause_clock.stop()
            self.bridge.set_manual_pause(False, on_result=lambda _: self.refresh())

    def set_pause_while_in_use(self, checked: bool) -> None:
        self.bridge.update_settings(pause_while_in_use=checked, on_result=lambda _: self.refresh())

    def set_start_at_login(self, checked: bool) -> None:
        try:
            if checked:
                where = autostart.enable(self.login_command)
                log.info("start at login registered in %s", where)
            else:
                autostart.disable()
        except autostart.AutostartError as exc:
            self.show_notice(Notice("Start at login", str(exc), "error"))
        else:
            self.bridge.update_settings(start_at_login=checked)
        self.refresh()

    def open_join_dialog(self) -> JoinDialog:
        if self.join_dialog is None:
            self.join_dialog = JoinDialog(self.bridge)
            self.join_dialog.finished.connect(self._join_dialog_closed)
        self.join_dialog.show()
        self.join_dialog.raise_()
        self.join_dialog.activateWindow()
        return self.join_dialog

    def _join_dialog_closed(self, _result: int) -> None:
        dialog, self.join_dialog = self.join_dialog, None
        if dialog is not None:
            dialog.deleteLater()

    def leave(self) -> None:
        if self.confirm_leave():
            self.bridge.leave()

    def open_chat(self):
        """Open (or raise) the chat window on the fleet's API address, if the agent has learnt one."""
        status = self.bridge.status
        url = status.api_url if status is not None else None
        if not url:  # say why: not in a fleet, or not approved (or nothing served) yet
            joined = status is not None and status.state != "not-joined"
            self.show_notice(Notice("Chat", NO_CHAT_ADDRESS if joined else NOT_JOINED_CHAT, "warning"))
            return None
        key = self.bridge.api_key  # sent as the bearer token: the console's API requires it
        if self.chat_window is not None and (self.chat_window.client.base_url != url.rstrip("/")
                                             or self.chat_window.client.api_key != key):
            self.chat_window.close()
            self.chat_window = None
        if self.chat_window is None:
            # here: the chat window's widgets load on its first opening, not with the tray
            from console.shared.chat_view import QtChatWindow
            from console.shared.conversations import ConversationStore

            # an https API (the service off loopback) is trusted only if it chains to the fleet CA;
            # the chats are this desktop user's, kept on disk (shared with their console's Chat page)
            self.chat_window = QtChatWindow(url, api_key=key, loop=self.bridge.loop,
                                            ca_pem=self.bridge.service.fleet_ca_pem, store=ConversationStore())
        self.chat_window.show()
        self.chat_window.raise_()
        self.chat_window.activateWindow()
        return self.chat_window

    def quit(self) -> None:
        self.shutdown()
        self.quit_requested.emit()

    def shutdown(self) -> None:
        """Close the windows, hide the icon and stop the agent (joins its thread)."""
        if self.chat_window is not None:
            self.chat_window.close()
            self.chat_window = None
        if self.join_dialog is not None:
            self.join_dialog.reject()
        self.icon.hide()
        self.bridge.close()
