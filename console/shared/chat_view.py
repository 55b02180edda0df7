"""The chat window, shared by the console and the tray agent: a thin Qt view over
:class:`console.shared.chat_model.ChatModel`.

The model is only touched on the GUI thread. Answers stream on an asyncio loop
(:class:`console.shared.loop_thread.LoopThread`: the tray passes its agent's loop, the console
may let the window own one); each delta is posted back through
:class:`console.shared.qt_async.QtAsync`, so tokens appear as they arrive without a widget ever
being touched from the loop's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import html
from collections.abc import Mapping
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QCloseEvent, QFont, QTextCursor
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from console.shared.chat_model import (
    DONE,
    FAILED,
    MODELS_TIMEOUT_S,
    REPLY_TIMEOUT_S,
    STOPPED,
    ChatClient,
    ChatError,
    ChatEvent,
    ChatModel,
    ReplyResult,
    async_stream_reply,
)
from console.shared.loop_thread import LoopThread
from console.shared.qt_async import QtAsync

ROLE_LABELS = {"user": "You", "assistant": "Fleet", "system": "System"}
ENDINGS = {STOPPED: "stopped", FAILED: "failed"}


class QtChatWindow(QWidget):
    """``QtChatWindow(api_url)``; ``loop``: an already running LoopThread to stream on (not owned);
    ``options``: extra fields for every request (``temperature``, ``max_tokens``...)."""

    def __init__(self, api_url: str, *, api_key: str | None = None, loop: LoopThread | None = None,
                 model: ChatModel | None = None, options: Mapping[str, Any] | None = None,
                 parent: QWidget | None = None, ca_pem: bytes | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"Deskfleet chat — {api_url}")
        self.resize(820, 560)
        self.client = ChatClient(api_url, api_key, ca_pem=ca_pem)  # ca_pem: the fleet CA, for an https API
        self._own_loop = loop is None
        self.loop = loop if loop is not None else LoopThread("deskfleet-chat").start()
        self.qt_async = QtAsync(self.loop, self)
        self.model = model or ChatModel()
        self.options = dict(options or {})  # extra request fields, e.g. temperature, max_tokens
        self._reply: concurrent.futures.Future | None = None
        self._reply_token: object | None = None  # tells this reply's late deltas from the next one's
        self._closed = False
        self._build()
        self.model.subscribe(self._on_event)
        for conversation in self.model.conversations:
            self._add_item(conversation.id)
        if self.model.current is None:
            self.model.new_conversation()
        else:
            self._render()
        self.refresh_models()

    # ---- layout --------------------------------------------------------------------------------

    def _build(self) -> None:
        self.conversation_list = QListWidget()
        self.new_button = QPushButton("New chat")
        self.new_button.clicked.connect(lambda: self.model.new_conversation())
        left = QWidget()
        left_box = QVBoxLayout(left)
        left_box.setContentsMargins(0, 0, 0, 0)
        left_box.addWidget(self.new_button)
        left_box.addWidget(self.conversation_list)
        self.conversation_list.currentItemChanged.connect(self._on_item_selected)

        self.model_choice = QComboBox()
        self.model_choice.setMinimumContentsLength(20)
        self.model_choice.currentTextChanged.connect(self._on_model_chosen)
        self.speed_label = QLabel("— tok/s")
        self.speed_label.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        top = QHBoxLayout()
        top.addWidget(QLabel("Model:"))
        top.addWidget(self.model_choice, 1)
        top.addWidget(self.speed_label)

        self.transcript = QTextBrowser()
        self.transcript.setOpenExternalLinks(False)
        self.error_label = QLabel()
        self.error_label.setWordWrap(True)
        self.error_label.setStyleSheet("color: #b3261e;")
        self.error_label.hide()

        self.input = QLineEdit()
        self.input.setPlaceholderText("Ask the fleet…  (Enter sends)")
        self.input.returnPressed.connect(self.send)
        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        bottom = QHBoxLayout()
        bottom.addWidget(self.input, 1)
        bottom.addWidget(self.send_button)
        bottom.addWidget(self.stop_button)

        right = QWidget()
        right_box = QVBoxLayout(right)
        right_box.setContentsMargins(0, 0, 0, 0)
        right_box.addLayout(top)
        right_box.addWidget(self.transcript, 1)
        right_box.addWidget(self.error_label)
        right_box.addLayout(bottom)

        splitter = QSplitter()
        splitter.addWidget(left)
        splitter.addWidget(right)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([200, 620])
        box = QVBoxLayout(self)
        box.addWidget(splitter)
        self._update_buttons()

    # ---- actions -------------------------------------------------------------------------------

    def refresh_models(self) -> None:
        self.qt_async.call(self.client.async_models(), timeout=MODELS_TIMEOUT_S + 5,
                           what="listing the fleet's models", on_result=self.model.set_models,
                           on_error=self._show_error)

    def send(self) -> None:
        """Send the input line in the current conversation and stream the answer."""
        conversation = self.model.current
        if conversation is None or self._reply is not None:
            return
        if self.model.model_name is None:
            self._show_error(ChatError("the fleet's API has listed no model yet; wait a moment or check the "
                                       "address"))
            return
        try:
            messages = self.model.start_reply(conversation.id, self.input.text())
        except ChatError as exc:
            self._show_error(exc)
            return
        self.input.clear()
        self._show_error(None)
        token = self._reply_token = object()
        on_delta = functools.partial(self._delta_from_loop, conversation.id, token)
        self._reply = self.qt_async.call(
            async_stream_reply(self.client, self.model.model_name, messages, on_delta, **self.options),
            timeout=REPLY_TIMEOUT_S, what="the answer",
            on_result=functools.partial(self._reply_done, conversation.id, token),
            on_error=functools.partial(self._reply_failed, conversation.id, token))
        self._update_buttons()

    def stop(self) -> None:
        """Stop the answer being streamed: its request is cancelled, so the fleet stops generating."""
        if self._reply is not None:
            self._reply.cancel()

    @property
    def streaming(self) -> bool:
        return self._reply is not None

    def shutdown(self) -> None:
        """Stop streaming and, if this window owns its loop, stop the loop (joins its thread)."""
        if self._closed:
            return
        self._closed = True
        self.stop()
        if self._own_loop:
            self.loop.stop()

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 (Qt's name)
        self.shutdown()
        super().closeEvent(event)

    # ---- results from the loop (delivered on the GUI thread) -----------------------------------

    def _delta_from_loop(self, conversation_id: int, token: object, text: str, at: float) -> None:
        self.qt_async.post(self._apply_delta, conversation_id, token, text, at)

    def _apply_delta(self, conversation_id: int, token: object, text: str, at: float) -> None:
        if token is self._reply_token:
            self.model.add_delta(conversation_id, text, at)

    def _reply_done(self, conversation_id: int, token: object, result: ReplyResult) -> None:
        if token is self._reply_token:
            self._reply = None
            self.model.end_reply(conversation_id, DONE, completion_tokens=result.completion_tokens)

    def _reply_failed(self, conversation_id: int, token: object, error: BaseException) -> None:
        if token is not self._reply_token:
            return
        self._reply = None
        if isinstance(error, asyncio.CancelledError):
            self.model.end_reply(conversation_id, STOPPED)
        else:
            self.model.end_reply(conversation_id, FAILED, error=str(error))
            self._show_error(error)

    def _show_error(self, error: BaseException | None) -> None:
        self.error_label.setText("" if error is None else str(error))
        self.error_label.setVisible(error is not None)

    # ---- model events -> widgets ---------------------------------------------------------------

    def _on_event(self, event: ChatEvent) -> None:
        if event.kind == "added":
            self._add_item(event.conversation_id)
        elif event.kind == "selected":
            self._select_item(event.conversation_id)
            self._render()
        elif event.kind == "models":
            self._fill_models()
        elif event.conversation_id == self.model.current_id:
            if event.kind == "delta":
                cursor = self.transcript.textCursor()
                cursor.movePosition(QTextCursor.MoveOperation.End)
                cursor.insertText(event.text)
                self.transcript.setTextCursor(cursor)
                self.transcript.ensureCursorVisible()
            else:
                self._render()
            self._update_title(event.conversation_id)
        self._update_speed()
        self._update_buttons()

    def _add_item(self, conversation_id: int) -> None:
        item = QListWidgetItem(self.model.get(conversation_id).title)
        item.setData(Qt.ItemDataRole.UserRole, conversation_id)
        self.conversation_list.addItem(item)

    def _items(self) -> list[QListWidgetItem]:
        return [self.conversation_list.item(i) for i in range(self.conversation_list.count())]

    def _select_item(self, conversation_id: int) -> None:
        for item in self._items():
            if item.data(Qt.ItemDataRole.UserRole) == conversation_id and not item.isSelected():
                self.conversation_list.setCurrentItem(item)

    def _update_title(self, conversation_id: int) -> None:
        for item in self._items():
            if item.data(Qt.ItemDataRole.UserRole) == conversation_id:
                item.setText(self.model.get(conversation_id).title)

    def _on_item_selected(self, item: QListWidgetItem | None, _previous: QListWidgetItem | None) -> None:
        if item is not None and item.data(Qt.ItemDataRole.UserRole) != self.model.current_id:
            self.model.select(item.data(Qt.ItemDataRole.UserRole))

    def _fill_models(self) -> None:
        self.model_choice.blockSignals(True)
        self.model_choice.clear()
        self.model_choice.addItems(self.model.models)
        if self.model.model_name is not None:
            self.model_choice.setCurrentText(self.model.model_name)
        self.model_choice.blockSignals(False)

    def _on_model_chosen(self, name: str) -> None:
        if name:
            self.model.model_name = name

    def _render(self) -> None:
        """The whole current conversation; streamed deltas are appended at the end afterwards."""
        conversation = self.model.current
        parts = []
        for m in conversation.messages if conversation else ():
            label = ROLE_LABELS.get(m.role, m.role)
            ending = f" <i>({ENDINGS[m.state]})</i>" if m.state in ENDINGS else ""
            body = html.escape(m.content).replace("\n", "<br>")
            parts.append(f"<p><b>{label}</b>{ending}<br>{body}</p>")
        self.transcript.setHtml("".join(parts))
        cursor = self.transcript.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        self.transcript.setTextCursor(cursor)

    def _update_speed(self) -> None:
        conversation = self.model.current
        replies = [m for m in conversation.messages if m.throughput is not None] if conversation else []
        rate = replies[-1].throughput.per_second if replies else None
        self.speed_label.setText("— tok/s" if rate is None else f"{rate:.1f} tok/s")

    def _update_buttons(self) -> None:
        busy = self._reply is not None
        self.send_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)
        self.model_choice.setEnabled(not busy)
        font = QFont(self.speed_label.font())
        font.setBold(busy)
        self.speed_label.setFont(font)
