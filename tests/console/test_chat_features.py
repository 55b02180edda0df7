"""The chat window (Qt offscreen, qtbot) against the fleet's real API on loopback (canned answers
over a real Router, tests/console/chat_helpers.py): Markdown with a working Copy link per code
block, the model picker when several models are served, Regenerate, Stop keeping the partial
text, chats kept on disk and listed, and the line saying why the fleet cannot answer."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication, QTextTable
from PySide6.QtWidgets import QTextBrowser

from console.shared.chat_model import DONE, FAILED, STOPPED
from console.shared.chat_view import QtChatWindow
from console.shared.conversations import ConversationStore
from console.shared.transcript import QtTranscript
from tests.console.chat_helpers import (
    MARKDOWN_ANSWER,
    MARKDOWN_CODE,
    PAUSE_DETAIL,
    PausedGenerator,
    SlowGenerator,
    chat_api,
)
from tests.support.api_helpers import ThinkingByteTokenizer
from tests.support.canned_api import CannedGenerator

WAIT_MS = 15000


def open_window(qtbot, url: str, **kwargs) -> QtChatWindow:
    kwargs.setdefault("options", {"max_tokens": 1000})  # the canned answers are bytes: 1 token each
    window = QtChatWindow(url, **kwargs)
    qtbot.addWidget(window)
    window.show()
    qtbot.waitUntil(lambda: window.fleet is not None, timeout=WAIT_MS)
    return window


def ask(qtbot, window: QtChatWindow, question: str) -> None:
    window.input.setText(question)
    window.send()
    assert window.streaming
    qtbot.waitUntil(lambda: not window.streaming, timeout=WAIT_MS)


def tables(view: QtChatWindow | QTextBrowser) -> list[QTextTable]:
    browser = view.transcript if isinstance(view, QtChatWindow) else view
    found = []
    block = browser.document().begin()
    while block.isValid():
        cursor = browser.textCursor()
        cursor.setPosition(block.position())
        table = cursor.currentTable()
        if table is not None and table not in found:
            found.append(table)
        block = block.next()
    return found


def test_a_markdown_answer_renders_and_its_code_block_copies(qtbot):
    with chat_api(fake=CannedGenerator(MARKDOWN_ANSWER)) as url:
        window = open_window(qtbot, url)
        try:
            assert window.fleet.ok and not window.fleet_label.isVisible()
            assert not window.model_choice.isVisible() and window.model_label.text() == "Model: fake"
            ask(qtbot, window, "How do I count words?")
            reply = window.model.current.messages[-1]
            assert reply.state == DONE and reply.content == MARKDOWN_ANSWER
            text = window.transcript.toPlainText()
            assert "```" not in text and "**" not in text and "| Input |" not in text
            assert "def count_words(text: str) -> dict[str, int]:" in text and "Copy" in text
            # the code block and the answer's table are real tables of the document (2 and 3 rows)
            shapes = sorted((t.rows(), t.columns()) for t in tables(window))
            assert shapes == [(2, 2), (3, 2)], shapes
            QGuiApplication.clipboard().clear()
            window.transcript.anchorClicked.emit(QUrl("copy:1:0"))  # what clicking "Copy" emits
            assert QGuiApplication.clipboard().text() == MARKDOWN_CODE
            assert window.copied_label.text() == "Code copied to the clipboard"
        finally:
            window.close()


def test_while_it_streams_only_the_answer_is_rerendered_and_it_reads_as_a_full_render(qtbot):
    """The streaming path replaces the answer's part of the document alone, delta after delta;
    sampled mid-answer (in its code block, list, table, quote), it reads as a full render of the chat
    in a second transcript."""
    reference = QtTranscript(lambda: None)
    qtbot.addWidget(reference)
    with chat_api(fake=SlowGenerator(MARKDOWN_ANSWER, delay=0.004)) as url:
        window = open_window(qtbot, url)
        try:
            ask(qtbot, window, "First question")  # a finished answer before the streamed one
            window.input.setText("How do I count words?")
            window.send()
            samples = []
            points = [150, 300, 400, 480]  # in the code block, the list, the table, the quote

            def sample() -> bool:
                content = window.model.current.messages[-1].content
                if window.streaming and points and len(content) >= points[0]:
                    points.pop(0)
                    window.transcript.render_streaming(window.model.current)
                    assert window.transcript.stream_at is not None  # the partial path, not a full render
                    streamed = (window.transcript.toPlainText(), len(tables(window)))
                    reference.show_conversation(window.model.current)
                    assert (reference.toPlainText(), len(tables(reference))) == streamed
                    samples.append(streamed)
                return not points or not window.streaming

            qtbot.waitUntil(sample, timeout=WAIT_MS)
            assert len(samples) >= 3, "the answer ended before it could be sampled"
            assert [n for _, n in samples][:3] == [3, 3, 4]  # its code block, then its table, grow in
            qtbot.waitUntil(lambda: not window.streaming, timeout=WAIT_MS)
            assert len(tables(window)) == 4  # two code blocks and two tables: both answers, whole
            assert window.transcript.stream_at is None
        finally:
            window.close()


def test_the_model_picker_appears_for_several_models_and_picks_the_one_asked(qtbot):
    alpha, beta = CannedGenerator("I am alpha."), CannedGenerator("I am beta.")
    with chat_api(alpha=alpha, beta=beta) as url:
        window = open_window(qtbot, url)
        try:
            assert window.model_choice.isVisible() and not window.model_label.isVisible()
            assert [window.model_choice.itemText(i) for i in range(window.model_choice.count())] == ["alpha", "beta"]
            window.model_choice.setCurrentText("beta")
            ask(qtbot, window, "Who are you?")
            assert window.model.current.messages[-1].content == "I am beta."
            assert len(beta.requests) == 1 and alpha.requests == []
            first = window.model.current
            assert first.model == "beta"
            window.model.new_conversation()
            window.model_choice.setCurrentText("alpha")
            ask(qtbot, window, "And you?")
            assert window.model.current.messages[-1].content == "I am alpha."
            window.model.select(first.id)  # a chat reopens on the model that answered it
            assert window.model_choice.currentText() == "beta" and window.model.model_name == "beta"
        finally:
            window.close()


def test_enter_sends_and_shift_enter_starts_a_new_line(qtbot):
    from PySide6.QtCore import Qt

    generator = CannedGenerator("Got it.")
    with chat_api(fake=generator) as url:
        window = open_window(qtbot, url)
        try:
            window.input.setFocus()
            qtbot.keyClicks(window.input, "first line")
            qtbot.keyClick(window.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
            qtbot.keyClicks(window.input, "second line")
            assert window.input.text() == "first line\nsecond line" and not window.streaming
            qtbot.keyClick(window.input, Qt.Key.Key_Return)
            qtbot.waitUntil(lambda: not window.streaming and window.model.current.messages[-1].state == DONE,
                            timeout=WAIT_MS)
            assert window.model.current.messages[0].content == "first line\nsecond line"
            assert window.input.text() == ""
            assert "first line\nsecond line" in window.transcript.toPlainText()  # the user's lines kept
        finally:
            window.close()


def test_regenerate_replaces_the_last_answer_with_a_new_one_to_the_same_question(qtbot):
    generator = CannedGenerator(lambda request, index: f"Answer number {index + 1}.")
    with chat_api(fake=generator) as url:
        window = open_window(qtbot, url)
        try:
            assert not window.regenerate_button.isEnabled()
            ask(qtbot, window, "Pick a number")
            assert window.regenerate_button.isEnabled()
            qtbot.mouseClick(window.regenerate_button, left())
            qtbot.waitUntil(lambda: not window.streaming, timeout=WAIT_MS)
            messages = window.model.current.messages
            assert [(m.role, m.content) for m in messages] == [("user", "Pick a number"),
                                                               ("assistant", "Answer number 2.")]
            assert generator.requests[0].prompt_ids == generator.requests[1].prompt_ids  # the same question
            assert "Answer number 1." not in window.transcript.toPlainText()
        finally:
            window.close()


def test_stop_keeps_the_partial_text_and_the_chats_are_kept_and_listed(qtbot, tmp_path):
    store = ConversationStore(tmp_path / "chats")
    story = "Once upon a time " * 40
    with chat_api(fake=SlowGenerator(story, delay=0.02)) as url:
        window = open_window(qtbot, url, store=store, options={"max_tokens": 900})
        try:
            window.input.setText("Tell me a story")
            window.send()
            # the transcript shows the answer as it streams: it grows between two looks, both mid-answer
            qtbot.waitUntil(lambda: "Once upon a time Once" in window.transcript.toPlainText(), timeout=WAIT_MS)
            early = window.transcript.toPlainText()
            qtbot.waitUntil(lambda: len(window.transcript.toPlainText()) > len(early) + 20, timeout=WAIT_MS)
            assert window.streaming and window.transcript.toPlainText().startswith(early.removesuffix("▍").rstrip())
            qtbot.mouseClick(window.stop_button, left())
            qtbot.waitUntil(lambda: not window.streaming, timeout=WAIT_MS)
            partial = window.model.current.messages[-1]
            assert partial.state == STOPPED and 10 < len(partial.content) < len(story)
            assert story.startswith(partial.content)
            assert "(stopped)" in window.transcript.toPlainText()
            window.model.new_conversation()
            window.options = {"max_tokens": 20}
            ask(qtbot, window, "Short one")
            window.rename_current("Brief")
        finally:
            window.close()
        saved = store.list().conversations
        assert [c.title for c in saved] == ["Brief", "Tell me a story"]
        assert saved[1].messages[-1].content == partial.content and saved[1].messages[-1].state == STOPPED

        again = open_window(qtbot, url, store=store)  # a later window (the tray's, or the next console)
        try:
            items = [again.conversation_list.item(i).text() for i in range(again.conversation_list.count())]
            assert items == ["New chat", "Brief", "Tell me a story"]  # opens on a fresh chat, newest first
            again.conversation_list.setCurrentRow(2)
            assert again.model.current.title == "Tell me a story"
            assert partial.content.strip()[:40] in again.transcript.toPlainText()
            again.delete_current()
            assert [c.title for c in store.list().conversations] == ["Brief"]
        finally:
            again.close()


def test_rename_and_delete_ask_first(qtbot, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QInputDialog, QMessageBox

    store = ConversationStore(tmp_path / "chats")
    with chat_api(fake=CannedGenerator("Fine.")) as url:
        window = open_window(qtbot, url, store=store)
        try:
            ask(qtbot, window, "How are you?")
            asked = []
            monkeypatch.setattr(QInputDialog, "getText",
                                lambda *a, **k: (asked.append(k.get("text")) or "Small talk", True))
            window.rename_button.click()
            assert asked == ["How are you?"] and window.conversation_list.item(0).text() == "Small talk"
            assert [c.title for c in store.list().conversations] == ["Small talk"]
            monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.No)
            window.delete_button.click()
            assert [c.title for c in store.list().conversations] == ["Small talk"]
            monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.Yes)
            window.delete_button.click()
            assert store.list().conversations == () and window.model.current.messages == []
            assert [window.conversation_list.item(i).text() for i in range(window.conversation_list.count())] \
                == ["New chat"]
        finally:
            window.close()


def test_a_paused_fleet_says_why_and_a_request_shows_it_too(qtbot):
    with chat_api(fake=PausedGenerator()) as url:
        window = open_window(qtbot, url)
        try:
            assert window.fleet.level == "paused" and window.fleet_label.isVisible()
            assert PAUSE_DETAIL in window.fleet_label.text() and "paused" in window.fleet_label.text()
            window.input.setText("Hello?")
            window.send()
            qtbot.waitUntil(lambda: not window.streaming, timeout=WAIT_MS)
            reply = window.model.current.messages[-1]
            assert reply.state == FAILED and "answered 503" in reply.error and PAUSE_DETAIL in reply.error
            assert "(failed)" in window.transcript.toPlainText() and PAUSE_DETAIL in window.transcript.toPlainText()
            assert window.fleet.level == "paused" and PAUSE_DETAIL in window.fleet_label.text()
            assert window.error_label.isHidden()  # said once in the transcript, once in the fleet line
        finally:
            window.close()


def test_a_window_closed_and_shown_again_on_a_shells_loop_looks_at_the_fleet_again(qtbot):
    """The tray keeps its chat window and shows it again: it must watch the fleet again then."""
    from console.shared.loop_thread import LoopThread

    with LoopThread("tray-like") as loop, chat_api(fake=PausedGenerator()) as url:
        window = open_window(qtbot, url, loop=loop)
        try:
            assert window.fleet.level == "paused"
            window.close()
            assert not window._health_timer.isActive()
            window.fleet = None
            window.show()
            qtbot.waitUntil(lambda: window.fleet is not None, timeout=WAIT_MS)
            assert window.fleet.level == "paused" and window._health_timer.isActive()
        finally:
            window.close()


def test_a_fleet_with_no_model_and_an_unreachable_one_say_so(qtbot):
    with chat_api() as url:
        window = open_window(qtbot, url)
        try:
            assert window.fleet.level == "down" and "serves no model yet" in window.fleet_label.text()
        finally:
            window.close()
    window = open_window(qtbot, "http://127.0.0.1:9/v1")
    try:
        assert window.fleet.level == "unreachable" and window.fleet_label.isVisible()
        assert "The fleet is unreachable — cannot reach the fleet's API at http://127.0.0.1:9/v1 " \
               "(connection refused: nothing listens there)" in window.fleet_label.text()
        window.input.setText("hello?")
        window.send()
        assert not window.streaming and "listed no model" in window.error_label.text()
    finally:
        window.close()


@pytest.fixture(autouse=True)
def _chats_in_tmp(monkeypatch, tmp_path):
    monkeypatch.setenv("DESKFLEET_CHATS_DIR", str(tmp_path / "default-chats"))


def left():
    from PySide6.QtCore import Qt

    return Qt.MouseButton.LeftButton


def test_a_thinking_models_reasoning_shows_folded_and_unfolds(qtbot, tmp_path):
    thought = "<think>\nThe user asks for France's capital.\nIt is Paris.\n</think>\n\nThe capital is **Paris**."
    store = ConversationStore(tmp_path / "chats")
    with chat_api(tokenizer=ThinkingByteTokenizer(), fake=CannedGenerator(thought)) as url:
        window = open_window(qtbot, url, store=store)
        try:
            ask(qtbot, window, "What is the capital of France?")
            reply = window.model.current.messages[-1]
            assert reply.reasoning == "The user asks for France's capital.\nIt is Paris."
            assert reply.content == "The capital is **Paris**."
            folded = window.transcript.toPlainText()
            assert "▸ Thought (9 words)" in folded and "France's capital" not in folded
            assert "The capital is Paris." in folded
            window.transcript.anchorClicked.emit(QUrl("think:1"))  # what clicking "Thought" emits
            unfolded = window.transcript.toPlainText()
            assert "▾ Thought" in unfolded and "The user asks for France's capital." in unfolded
            window.transcript.anchorClicked.emit(QUrl("think:1"))
            assert "France's capital" not in window.transcript.toPlainText()
            saved_id = window.model.current.id
        finally:
            window.close()
    listing = store.list()
    saved = next(c for c in listing.conversations if c.id == saved_id)
    assert not listing.damaged
    assert saved.messages[-1].reasoning == reply.reasoning and saved.messages[-1].content == reply.content
    assert all("reasoning" not in m for m in saved.history())  # the answer alone goes back as context
