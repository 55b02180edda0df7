"""The chat's transcript: one conversation as rich text, answers rendered from Markdown
(:mod:`console.shared.markdown`), each code block with a "Copy" link.

Cheap while an answer streams: a full render (:meth:`QtTranscript.show_conversation`) sets the finished
messages' HTML (kept per message, so it is built once) and puts the answer being streamed after
them; each later delta (:meth:`QtTranscript.streamed`) replaces only that answer's part of the
document, at most every :data:`RENDER_EVERY_MS` or twice the last render's cost, whichever is
longer, so a long chat costs a small render per frame rather than a new document per token.
A Copy link's address is ``copy:<message index>:<block index>``; clicking it puts the block's
exact text on the clipboard and emits :attr:`QtTranscript.code_copied`. A thinking model's
reasoning shows folded under a "Thought" link (``think:<message index>``) that unfolds it.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable

from PySide6.QtCore import QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication, QTextCursor
from PySide6.QtWidgets import QTextBrowser, QWidget

from console.shared import markdown
from console.shared.chat_model import FAILED, STOPPED, STREAMING, Conversation, Message

ROLE_LABELS = {"user": "You", "assistant": "Fleet", "system": "System"}
ROLE_COLOURS = {"user": "#1a4e8a"}
OTHER_COLOUR = "#3c4043"
THINKING_COLOUR = "#6b6f76"
ENDINGS = {STOPPED: "stopped", FAILED: "failed"}
RENDER_EVERY_MS = 60
CACHE_LIMIT = 500  # messages' HTML kept; past it the cache starts afresh


def thinking_html(index: int, m: Message, unfolded: bool) -> str:
    """A thinking model's reasoning: one "Thought" link when folded (the default), the text under it
    when unfolded; the link's address ``think:<message index>`` folds and unfolds it."""
    if not m.reasoning:
        return ""
    words = len(m.reasoning.split())
    busy = m.state == STREAMING and not m.content
    title = f"{'Thinking…' if busy else 'Thought'} ({words} word{'s' if words != 1 else ''})"
    link = f'<p><a href="think:{index}" style="color: {THINKING_COLOUR};">{"▾" if unfolded else "▸"} {title}</a></p>'
    if not unfolded:
        return link
    text = html.escape(m.reasoning).replace("\n", "<br/>")
    return link + f'<p style="color: {THINKING_COLOUR}; margin-left: 12px;"><i>{text}</i></p>'


def message_html(index: int, m: Message, unfolded: bool = False) -> markdown.Rendered:
    """One message's HTML (label, reasoning, body, how it ended) and its code blocks."""
    label = ROLE_LABELS.get(m.role, m.role)
    ending = f" <i>({ENDINGS[m.state]})</i>" if m.state in ENDINGS else ""
    code: tuple[markdown.CodeBlock, ...] = ()
    if m.role == "assistant":
        rendered = markdown.render(m.content, copy_prefix=f"copy:{index}:")
        code = rendered.code_blocks
        body = thinking_html(index, m, unfolded) + rendered.html + ("<p>▍</p>" if m.state == STREAMING else "")
        if m.state == FAILED and m.error:
            body += f'<p style="color: #b3261e;">{html.escape(m.error)}</p>'
    else:  # what a person typed is shown as typed
        body = "<p>" + html.escape(m.content).replace("\n", "<br/>") + "</p>"
    colour = ROLE_COLOURS.get(m.role, OTHER_COLOUR)
    return markdown.Rendered(f'<p style="margin-top: 12px;"><b style="color: {colour};">{label}</b>{ending}</p>{body}',
                             code)


class QtTranscript(QTextBrowser):
    """``current()``: the conversation to show when a delayed render fires."""

    code_copied = Signal(str)

    def __init__(self, current: Callable[[], Conversation | None], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._current = current
        self.setOpenLinks(False)  # Copy links and web links are handled in _on_anchor
        self.anchorClicked.connect(self._on_anchor)
        self._cache: dict[tuple[int, str, str, str, str, bool], markdown.Rendered] = {}
        self._unfolded: set[tuple[str, int]] = set()  # (chat, message index) whose reasoning is shown
        self._code: dict[int, tuple[markdown.CodeBlock, ...]] = {}  # message index -> its code blocks
        self._timer = QTimer(self, singleShot=True, interval=RENDER_EVERY_MS)
        self._timer.timeout.connect(lambda: self.render_streaming(self._current()))
        self._last_render = 0.0
        self._render_cost_ms = 0.0  # the last streaming render's; the next waits at least twice that
        self.stream_at: tuple[str, int, int] | None = None  # (chat, message index, where its HTML starts)

    # ---- rendering -----------------------------------------------------------------------------

    def show_conversation(self, conversation: Conversation | None) -> None:
        """Render ``conversation`` whole."""
        self._timer.stop()
        self._last_render = time.monotonic()
        self._code = {}
        self.stream_at = None
        scroll = self.verticalScrollBar()
        at_end = scroll.value() >= scroll.maximum() - 4
        messages = conversation.messages if conversation else []
        streaming = conversation is not None and conversation.streaming
        finished = messages[:-1] if streaming else messages
        parts = [self._html(i, m) for i, m in enumerate(finished)]
        if len(self._cache) > CACHE_LIMIT:
            self._cache.clear()
        self.setHtml("".join(parts))
        if streaming:
            assert conversation is not None
            cursor = QTextCursor(self.document())
            cursor.movePosition(QTextCursor.MoveOperation.End)
            if parts:
                cursor.insertBlock()  # the answer's first paragraph must not join the last one before it
            self.stream_at = (conversation.id, len(messages) - 1, cursor.position())
            cursor.insertHtml(self._html(len(messages) - 1, messages[-1]))
        if at_end or streaming:
            scroll.setValue(scroll.maximum())

    def streamed(self) -> None:
        """A delta arrived: render now if the last render is old enough, else when the timer fires."""
        if self._timer.isActive():
            return
        every = max(RENDER_EVERY_MS, 2 * self._render_cost_ms)
        wait = every - (time.monotonic() - self._last_render) * 1000
        if wait <= 0:
            self.render_streaming(self._current())
        else:
            self._timer.start(int(wait))

    def render_streaming(self, conversation: Conversation | None) -> None:
        """Replace only the streamed answer's part of the document (from where the last full render
        put it) with its new HTML; a full render when there is no such part."""
        if (conversation is None or not conversation.streaming or self.stream_at is None
                or self.stream_at[:2] != (conversation.id, len(conversation.messages) - 1)):
            self.show_conversation(conversation)
            return
        started = time.monotonic()
        self._timer.stop()
        scroll = self.verticalScrollBar()
        at_end = scroll.value() >= scroll.maximum() - 4
        index = len(conversation.messages) - 1
        cursor = QTextCursor(self.document())
        cursor.setPosition(self.stream_at[2])
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.insertHtml(self._html(index, conversation.messages[index]))
        if at_end:
            scroll.setValue(scroll.maximum())
        self._last_render = time.monotonic()
        self._render_cost_ms = (self._last_render - started) * 1000

    def _html(self, index: int, m: Message) -> str:
        conversation = self._current()
        unfolded = conversation is not None and (conversation.id, index) in self._unfolded
        key = (index, m.role, m.state, m.content, m.reasoning, unfolded)
        rendered = self._cache.get(key)
        if rendered is None:
            rendered = message_html(index, m, unfolded)
            if m.state != STREAMING:
                self._cache[key] = rendered
        self._code[index] = rendered.code_blocks
        return rendered.html

    # ---- links ---------------------------------------------------------------------------------

    def toggle_thinking(self, message_index: str | int) -> None:
        """Fold or unfold the reasoning of message ``message_index`` of the chat shown."""
        conversation = self._current()
        try:
            key = (conversation.id, int(message_index)) if conversation is not None else None
        except ValueError:
            return  # not a message index: a link of another kind of render
        if key is not None:
            self._unfolded ^= {key}
            self.show_conversation(conversation)

    def copy_code(self, message_index: int, block: int) -> str:
        """Put code block ``block`` of message ``message_index`` on the clipboard; return its text."""
        code = self._code[message_index][block].text
        QGuiApplication.clipboard().setText(code)
        self.code_copied.emit(code)
        return code

    def _on_anchor(self, url: QUrl) -> None:
        if url.scheme() == "copy":
            try:
                message, block = (int(part) for part in url.path().split(":"))
                self.copy_code(message, block)
            except (ValueError, KeyError, IndexError):
                pass  # a link of an older render: nothing to copy
        elif url.scheme() == "think":
            self.toggle_thinking(url.path())
        elif url.scheme() in ("http", "https", "mailto"):
            QDesktopServices.openUrl(url)
