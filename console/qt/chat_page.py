"""The Chat page: the chat window shared with the tray, on the OpenAI API the console serves over
the fleet's coordinator. Until a ring is up there is nothing to talk to, so the page says how
to get one; when the API comes up (or moves) the chat is (re)created on its address. It streams
on the console's loop (not owned: the console stops it). The chats are the admin's own, kept on
disk per user (shared with the tray's chat of the same person); ``store`` picks another place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from console.qt.api_snippets import mask_key
from console.qt.service_serving import ServiceServing, ServingPhase
from console.shared.chat_view import QtChatWindow
from console.shared.conversations import ConversationStore
from console.shared.loop_thread import LoopThread

WAITING = ("No model is served yet. Place a model (Placement page) and distribute it (Distribution page); "
           "the chat then talks to the fleet through the console's OpenAI-compatible API, which other "
           "programs can use too.")


class QtChatPage(QWidget):
    def __init__(self, serving: ServiceServing, loop: LoopThread, *, options: Mapping[str, Any] | None = None,
                 parent: QWidget | None = None, store: ConversationStore | None = None) -> None:
        super().__init__(parent)
        self.loop = loop
        self.store = store if store is not None else ConversationStore()
        self.serving = serving
        self.options = dict(options or {})
        self.chat: QtChatWindow | None = None
        self.url_label = QLabel()
        self.url_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.copy_key_button = QPushButton("Copy key")  # the key is masked on screen (others may look on)
        self.copy_key_button.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.serving.api_key or ""))
        self.copy_key_button.hide()
        self.placeholder = QLabel(WAITING)
        self.placeholder.setWordWrap(True)
        self.box = QVBoxLayout(self)
        top = QHBoxLayout()
        top.addWidget(self.url_label, 1)
        top.addWidget(self.copy_key_button)
        self.box.addLayout(top)
        self.box.addWidget(self.placeholder, 1)
        serving.api_ready.connect(self.show_api)
        serving.phase_changed.connect(self._on_phase)

    def show_api(self, url: str) -> None:
        key = self.serving.api_key
        self.url_label.setText(f"OpenAI-compatible API: {url}  API key: {mask_key(key)}  (snippets for programs: "
                               "the Keys page)" if key else f"OpenAI-compatible API: {url}")
        self.copy_key_button.setVisible(bool(key))
        if (self.chat is not None and self.chat.client.base_url == url.rstrip("/")
                and self.chat.client.api_key == key):
            self.chat.check_fleet()
            return
        self._drop_chat()
        # an https API (the service off loopback) is trusted only if it chains to the fleet CA
        self.chat = QtChatWindow(url, api_key=key, loop=self.loop, options=self.options, parent=self,
                                 ca_pem=getattr(self.serving, "ca_pem", None), store=self.store)
        self.placeholder.hide()
        self.box.addWidget(self.chat, 1)

    def _on_phase(self, phase: str) -> None:
        if phase == ServingPhase.IDLE:
            self._drop_chat()
            self.url_label.clear()
            self.copy_key_button.hide()
            self.placeholder.show()

    def _drop_chat(self) -> None:
        if self.chat is not None:
            self.chat.shutdown()
            self.box.removeWidget(self.chat)
            self.chat.deleteLater()
            self.chat = None

    def shutdown(self) -> None:
        self._drop_chat()
