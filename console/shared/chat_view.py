"""The chat window, shared by the console and the tray agent: a thin Qt view over
:class:`console.shared.chat_model.ChatModel`.

The model is only touched on the GUI thread. Answers stream on an asyncio loop
(:class:`console.shared.loop_thread.LoopThread`: the tray passes its agent's loop, the console
may let the window own one); each delta is posted back through
:class:`console.shared.qt_async.QtAsync`, so tokens appear as they arrive without a widget ever
being touched from the loop's thread.

Answers are Markdown, each code block with a "Copy" link, in the transcript
(:mod:`console.shared.transcript`), which re-renders only the streamed answer, at most once a
frame. With a store (:class:`console.shared.conversations.ConversationStore`) the chats are
kept on disk and listed newest first. A line above the input says whether the fleet can answer now and, if not, why
(:mod:`console.shared.fleet_line`), from ``/health`` every :data:`HEALTH_EVERY_S` and from each
failed call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import Mapping
from typing import Any

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QCloseEvent, QFont, QShowEvent
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMessageBox,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from console.shared import fleet_line
from console.shared.chat_input import QtChatInput
from console.shared.chat_model import (
    DONE,
    FAILED,
    MODELS_TIMEOUT_S,
    REPLY_TIMEOUT_S,
    STOPPED,
    ChatClient,
    ChatError,
    ChatEvent,
    ChatEventKind,
    ChatModel,
    ReplyResult,
    async_stream_reply,
)
from console.shared.conversations import SAVED_ON, ConversationStore, Damaged, keep
from console.shared.loop_thread import LoopThread
from console.shared.qt_async import QtAsync
from console.shared.transcript import QtTranscript

HEALTH_EVERY_S = 10.0
COPIED_FOR_MS = 2500


class QtChatWindow(QWidget):
    """``QtChatWindow(api_url)``; ``loop``: an already running LoopThread to stream on (not owned);
    ``options``: extra fields for every request (``temperature``, ``max_tokens``...); ``store``:
    where the chats are kept (None: in memory only, for this window's life)."""

    def __init__(self, api_url: str, *, api_key: str | None = None, loop: LoopThread | None = None,
                 model: ChatModel | None = None, options: Mapping[str, Any] | None = None,
                 parent: QWidget | None = None, ca_pem: bytes | None = None,
                 store: ConversationStore | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle(f"Deskfleet chat — {api_url}")
        self.resize(900, 600)
        self.client = ChatClient(api_url, api_key, ca_pem=ca_pem)  # ca_pem: the fleet CA, for an https API
        self._own_loop = loop is None
        self.loop = loop if loop is not None else LoopThread("deskfleet-chat").start()
        self.qt_async = QtAsync(self.loop, self)
        self.model = model or ChatModel()
        self.options = dict(options or {})  # extra request fields, e.g. temperature, max_tokens
        self.store = store
        self.fleet: fleet_line.FleetLine | None = None  # the last line shown; None before the first look
        self._reply: concurrent.futures.Future | None = None
        self._reply_token: object | None = None  # tells this reply's late deltas from the next one's
        self._checking = False
        self._closed = False
        self._build()
        damaged: tuple[Damaged, ...] = ()
        if store is not None:
            damaged = keep(self.model, store, on_error=self._show_error).damaged
        self._show_damaged(damaged)
        self.model.subscribe(self._on_event)
        self._fill_list()
        if self.model.current is None:
            self.model.new_conversation()  # a window opens on a fresh chat; the saved ones are listed
        else:
            self.transcript.show_conversation(self.model.current)
        self.check_fleet()
        self._health_timer.start()

    # ---- layout --------------------------------------------------------------------------------

    def _build(self) -> None:
        self.conversation_list = QListWidget()
        self.conversation_list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.conversation_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.conversation_list.currentItemChanged.connect(self._on_item_selected)
        self.conversation_list.itemDoubleClicked.connect(lambda _item: self.ask_rename())
        self.new_button = QPushButton("New chat")
        self.new_button.clicked.connect(lambda: self.model.new_conversation())
        self.rename_button = QPushButton("Rename…")
        self.rename_button.clicked.connect(self.ask_rename)
        self.delete_button = QPushButton("Delete…")
        self.delete_button.clicked.connect(self.ask_delete)
        self.damaged_label = QLabel()
        self.damaged_label.setWordWrap(True)
        self.damaged_label.setStyleSheet("color: #8a5a00;")
        self.damaged_label.hide()
        edits = QHBoxLayout()
        edits.addWidget(self.rename_button)
        edits.addWidget(self.delete_button)
        left = QWidget()
        left_box = QVBoxLayout(left)
        left_box.setContentsMargins(0, 0, 0, 0)
        left_box.addWidget(self.new_button)
        left_box.addWidget(self.conversation_list, 1)
        left_box.addLayout(edits)
        left_box.addWidget(self.damaged_label)

        self.model_choice = QComboBox()  # shown when the fleet serves several models
        self.model_choice.setMinimumContentsLength(20)
        self.model_choice.currentTextChanged.connect(self._on_model_chosen)
        self.model_label = QLabel("Model: —")  # shown when it serves one (or none yet)
        self.model_choice_label = QLabel("Model:")
        self.copied_label = QLabel()
        self.copied_label.setStyleSheet("color: #1e7d32;")
        self.speed_label = QLabel("— tok/s")
        self.speed_label.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        top = QHBoxLayout()
        top.addWidget(self.model_choice_label)
        top.addWidget(self.model_choice, 1)
        top.addWidget(self.model_label, 1)
        top.addWidget(self.copied_label)
        top.addWidget(self.speed_label)
        self._copied_timer = QTimer(self, singleShot=True, interval=COPIED_FOR_MS)
        self._copied_timer.timeout.connect(self.copied_label.clear)

        self.transcript = QtTranscript(lambda: self.model.current)
        self.transcript.code_copied.connect(self._code_copied)

        self.fleet_label = QLabel()  # whether the fleet can answer now, and why not
        self.fleet_label.setWordWrap(True)
        self.fleet_label.hide()
        self.error_label = QLabel()  # what went wrong with the last action in this window
        self.error_label.setWordWrap(True)
        self.error_label.setStyleSheet("color: #b3261e;")
        self.error_label.hide()
        self._health_timer = QTimer(self, interval=int(HEALTH_EVERY_S * 1000))
        self._health_timer.timeout.connect(self.check_fleet)

        self.input = QtChatInput()
        self.input.setPlaceholderText("Ask the fleet…  (Enter sends, Shift+Enter starts a new line)")
        self.input.returnPressed.connect(self.send)
        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.regenerate_button = QPushButton("Regenerate")
        self.regenerate_button.setToolTip("Ask the last question again; the new answer replaces the last one")
        self.regenerate_button.clicked.connect(self.regenerate)
        bottom = QHBoxLayout()
        bottom.addWidget(self.input, 1)
        bottom.addWidget(self.send_button)
        bottom.addWidget(self.stop_button)
        bottom.addWidget(self.regenerate_button)

        right = QWidget()
        right_box = QVBoxLayout(right)
        right_box.setContentsMargins(0, 0, 0, 0)
        right_box.addLayout(top)
        right_box.addWidget(self.transcript, 1)
        right_box.addWidget(self.fleet_label)
        right_box.addWidget(self.error_label)
        right_box.addLayout(bottom)

        splitter = QSplitter()
        splitter.addWidget(left)
        splitter.addWidget(right)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([220, 680])
        box = QVBoxLayout(self)
        box.addWidget(splitter)
        self._fill_models()
        self._update_buttons()

    # ---- actions -------------------------------------------------------------------------------

    def check_fleet(self) -> None:
        """Ask ``/health`` and ``/v1/models`` how the fleet is; the line and the picker follow."""
        if self._checking or self._closed:
            return
        self._checking = True

        async def look() -> tuple[fleet_line.FleetLine, list[str] | None]:
            try:
                status, doc = await self.client.async_health()
            except ChatError as exc:
                return fleet_line.from_error(exc), None
            try:
                models = await self.client.async_models()
            except ChatError as exc:
                return fleet_line.from_error(exc), None
            return fleet_line.from_health(status, doc), models

        self.qt_async.call(look(), timeout=2 * MODELS_TIMEOUT_S + 5, what="asking how the fleet is",
                           on_result=self._fleet_looked, on_error=self._fleet_look_failed)

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
        self._stream(conversation.id, messages)

    def regenerate(self) -> None:
        """Ask the current chat's last question again; the new answer replaces the last one."""
        conversation = self.model.current
        if conversation is None or self._reply is not None or self.model.model_name is None:
            return
        try:
            messages = self.model.regenerate(conversation.id)
        except ChatError as exc:
            self._show_error(exc)
            return
        self._stream(conversation.id, messages)

    def _stream(self, conversation_id: str, messages: list[dict[str, str]]) -> None:
        model_name = self.model.model_name
        if model_name is None:  # the callers checked: no model, no question sent
            return
        self._show_error(None)
        token = self._reply_token = object()
        on_delta = functools.partial(self._delta_from_loop, conversation_id, token, False)
        on_reasoning = functools.partial(self._delta_from_loop, conversation_id, token, True)
        self._reply = self.qt_async.call(
            async_stream_reply(self.client, model_name, messages, on_delta, on_reasoning=on_reasoning,
                               **self.options),
            timeout=REPLY_TIMEOUT_S, what="the answer",
            on_result=functools.partial(self._reply_done, conversation_id, token),
            on_error=functools.partial(self._reply_failed, conversation_id, token))
        self._update_buttons()

    def stop(self) -> None:
        """Stop the answer being streamed: its request is cancelled, so the fleet stops generating;
        the text received so far stays (marked "stopped")."""
        if self._reply is not None:
            self._reply.cancel()

    def rename_current(self, title: str) -> None:
        if self.model.current is not None:
            try:
                self.model.rename(self.model.current.id, title)
            except ChatError as exc:
                self._show_error(exc)

    def delete_current(self) -> None:
        if self.model.current is not None:
            try:
                self.model.remove(self.model.current.id)
            except ChatError as exc:
                self._show_error(exc)

    def ask_rename(self) -> None:
        conversation = self.model.current
        if conversation is None:
            return
        title, ok = QInputDialog.getText(self, "Rename chat", "Name:", text=conversation.title)
        if ok:
            self.rename_current(title)

    def ask_delete(self) -> None:
        conversation = self.model.current
        if conversation is None:
            return
        answer = QMessageBox.question(self, "Delete chat", f"Delete the chat {conversation.title!r}? "
                                      "Its saved copy is deleted too.")
        if answer == QMessageBox.StandardButton.Yes:
            self.delete_current()

    def _code_copied(self, _code: str) -> None:
        self.copied_label.setText("Code copied to the clipboard")
        self._copied_timer.start()

    @property
    def streaming(self) -> bool:
        return self._reply is not None

    def shutdown(self) -> None:
        """Stop streaming and looking at the fleet. A window on a loop of its own stops that loop
        (joins its thread) and is done; one on a shell's loop (the tray's) can be shown again and
        looks at the fleet again then."""
        self._health_timer.stop()
        self.stop()
        if self._own_loop and not self._closed:
            self._closed = True
            self.loop.stop()

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 (Qt's name)
        self.shutdown()
        super().closeEvent(event)

    def showEvent(self, event: QShowEvent) -> None:  # noqa: N802 (Qt's name)
        super().showEvent(event)
        if not self._closed and not self._health_timer.isActive():
            self._health_timer.start()
            self.check_fleet()

    # ---- results from the loop (delivered on the GUI thread) -----------------------------------

    def _fleet_looked(self, result: tuple[fleet_line.FleetLine, list[str] | None]) -> None:
        self._checking = False
        line, models = result
        if models is not None and models != self.model.models:
            self.model.set_models(models)
        self._show_fleet(line)

    def _fleet_look_failed(self, error: BaseException) -> None:
        self._checking = False
        if isinstance(error, ChatError):
            self._show_fleet(fleet_line.from_error(error))

    def _delta_from_loop(self, conversation_id: str, token: object, reasoning: bool, text: str, at: float) -> None:
        self.qt_async.post(self._apply_delta, conversation_id, token, reasoning, text, at)

    def _apply_delta(self, conversation_id: str, token: object, reasoning: bool, text: str, at: float) -> None:
        if token is self._reply_token:
            self.model.add_delta(conversation_id, text, at, reasoning=reasoning)

    def _reply_done(self, conversation_id: str, token: object, result: ReplyResult) -> None:
        if token is self._reply_token:
            self._reply = None
            self.model.end_reply(conversation_id, DONE, completion_tokens=result.completion_tokens)

    def _reply_failed(self, conversation_id: str, token: object, error: BaseException) -> None:
        if token is not self._reply_token:
            return
        self._reply = None
        if isinstance(error, asyncio.CancelledError):
            self.model.end_reply(conversation_id, STOPPED)
        else:
            self.model.end_reply(conversation_id, FAILED, error=str(error))  # the transcript shows it
            if isinstance(error, ChatError):  # and the fleet line says what it means for the fleet
                self._show_fleet(fleet_line.from_error(error))
                self.check_fleet()
            else:
                self._show_error(error)

    def _show_error(self, error: BaseException | None) -> None:
        self.error_label.setText("" if error is None else str(error))
        self.error_label.setVisible(error is not None)

    def _show_fleet(self, line: fleet_line.FleetLine) -> None:
        self.fleet = line
        self.fleet_label.setText(line.text)
        self.fleet_label.setStyleSheet(f"color: {line.colour}; background-color: {line.background}; "
                                       "font-weight: bold; padding: 6px; border-radius: 4px;")
        self.fleet_label.setVisible(not line.ok)

    def _show_damaged(self, damaged) -> None:
        if damaged:
            self.damaged_label.setText(f"{len(damaged)} saved chat(s) could not be read and were left as they "
                                       "are: " + "; ".join(map(str, damaged)))
        self.damaged_label.setVisible(bool(damaged))

    # ---- model events -> widgets ---------------------------------------------------------------

    def _on_event(self, event: ChatEvent) -> None:
        if event.kind in (ChatEventKind.ADDED, ChatEventKind.REMOVED, ChatEventKind.LISTED):
            self._fill_list()
        elif event.kind is ChatEventKind.SELECTED:
            self._select_item(event.conversation_id)
            self._fill_models()  # a chat reopens on the model that answered it, while it is served
            self.transcript.show_conversation(self.model.current)
        elif event.kind is ChatEventKind.MODELS:
            self._fill_models()
        elif event.conversation_id == self.model.current_id:
            if event.kind is ChatEventKind.DELTA:
                self.transcript.streamed()
            else:
                self.transcript.show_conversation(self.model.current)
            if event.kind in SAVED_ON:
                self._fill_list()
        elif event.kind in SAVED_ON:
            self._fill_list()
        self._update_speed()
        self._update_buttons()

    def _fill_list(self) -> None:
        self.conversation_list.blockSignals(True)
        self.conversation_list.clear()
        for conversation in self.model.newest_first():
            item = QListWidgetItem(conversation.title)
            item.setData(Qt.ItemDataRole.UserRole, conversation.id)
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(conversation.updated))
            item.setToolTip(f"{conversation.title}\nlast message {when}" +
                            (f" · {conversation.model}" if conversation.model else ""))
            self.conversation_list.addItem(item)
            if conversation.id == self.model.current_id:
                self.conversation_list.setCurrentItem(item)
        self.conversation_list.blockSignals(False)

    def _items(self) -> list[QListWidgetItem]:
        return [self.conversation_list.item(i) for i in range(self.conversation_list.count())]

    def _select_item(self, conversation_id: str | None) -> None:
        for item in self._items():
            if item.data(Qt.ItemDataRole.UserRole) == conversation_id and not item.isSelected():
                self.conversation_list.blockSignals(True)
                self.conversation_list.setCurrentItem(item)
                self.conversation_list.blockSignals(False)

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
        several = len(self.model.models) > 1
        self.model_choice.setVisible(several)
        self.model_choice_label.setVisible(several)
        self.model_label.setVisible(not several)
        self.model_label.setText(f"Model: {self.model.models[0]}" if self.model.models else "Model: —")

    def _on_model_chosen(self, name: str) -> None:
        if name:
            self.model.model_name = name

    def _update_speed(self) -> None:
        conversation = self.model.current
        throughputs = [m.throughput for m in conversation.messages if m.throughput is not None] if conversation else []
        rate = throughputs[-1].per_second if throughputs else None
        self.speed_label.setText("— tok/s" if rate is None else f"{rate:.1f} tok/s")

    def _update_buttons(self) -> None:
        busy = self._reply is not None
        conversation = self.model.current
        self.send_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)
        self.regenerate_button.setEnabled(not busy and conversation is not None and conversation.can_regenerate)
        self.model_choice.setEnabled(not busy)
        self.delete_button.setEnabled(not (busy and conversation is not None and conversation.streaming))
        font = QFont(self.speed_label.font())
        font.setBold(busy)
        self.speed_label.setFont(font)

