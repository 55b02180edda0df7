"""The tray icon and its menu: a thin view over :class:`agent.tray.bridge.AgentBridge`.

What each action shows (text, enabled, checked, visible) is decided by
:func:`agent.tray.tray_model.menu_state`; this class copies it onto the QActions whenever the
status changes, and turns clicks into bridge calls. Notifications go through
``QSystemTrayIcon.showMessage`` and are also kept in ``notices``, the record of what the person
was told (where no tray exists they would otherwise vanish).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QMenu, QMessageBox, QSystemTrayIcon

from agent.tray import autostart
from agent.tray.bridge import AgentBridge
from agent.tray.icons import state_icon
from agent.tray.join_dialog import JoinDialog
from agent.tray.tray_model import NO_CHAT_ADDRESS, STARTING, MenuState, Notice, menu_state
from engine.control.messages import AgentStatus

log = logging.getLogger(__name__)

NOTICE_MS = 8000
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
        return menu_state(self.bridge.status, self.bridge.settings, login)

    def refresh(self, status: AgentStatus | None = None) -> None:
        status = status if status is not None else self.bridge.status
        m = self.current_menu_state()
        self.state = status.state if status is not None else STARTING
        if status is None and self.bridge.start_error is not None:
            m = replace(m, status=f"Error: could not start ({self.bridge.start_error})"[:90])
            self.state = "error"
        self.status_action.setText(m.status)
        self.pause_action.setText(m.pause_text)
        self.pause_action.setEnabled(m.pause_enabled and self.bridge.running)
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
        self.bridge.set_manual_pause(not paused)

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
        if not url:
            self.show_notice(Notice("Chat", NO_CHAT_ADDRESS, "warning"))
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
