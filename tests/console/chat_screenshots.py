"""Screenshots of the chat window (the console's Chat page and the tray's chat are this window),
against the fleet's real API on loopback (tests/console/chat_helpers.py):

- ``chat-markdown.png``: a Markdown answer with a code block (its Copy link just clicked), a
  numbered list and a table, two models served so the picker shows;
- ``chat-history.png``: the chats kept on disk, listed newest first, an older one opened, and the
  line naming a saved file that could not be read;
- ``chat-paused.png``: the fleet's ring paused (an agent's user came back, no spare): the line says
  why, and the question's failure says the same;
- ``chat-unreachable.png``: nothing listens at the API's address.

Run by tests/console/test_chat_screenshots.py under Xvfb when it can, else offscreen. Standalone::

    xvfb-run -a env QT_QPA_PLATFORM=xcb python -m tests.console.chat_screenshots --out DIR --work TMP
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

NAMES = ("chat-markdown.png", "chat-history.png", "chat-paused.png", "chat-unreachable.png")
SAVED = (("Holiday rota for March", "Who is off in the week of the 9th?", "Anna and Ben, from Monday to Wednesday."),
         ("Printer on floor 2", "The printer on floor 2 says *PC LOAD LETTER*.",
          "It wants **letter** paper in tray 1."),
         ("Summarise the Q3 report", "Summarise the Q3 report in three bullets.",
          "- Revenue up 4 %\n- Costs flat\n- Two new offices"))


def take_chat_screenshots(out: Path, work: Path) -> list[Path]:
    from PySide6.QtCore import QUrl
    from PySide6.QtWidgets import QApplication

    from console.shared.chat_model import DONE, ChatModel
    from console.shared.chat_view import QtChatWindow
    from console.shared.conversations import ConversationStore, keep
    from tests.console.chat_helpers import MARKDOWN_ANSWER, PausedGenerator, chat_api
    from tests.support.canned_api import CannedGenerator
    from tests.support.xvfb import qt_wait

    out.mkdir(parents=True, exist_ok=True)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    written: list[Path] = []

    def save(window, name: str) -> None:
        settle(app)
        path = out / name
        if not window.grab().save(str(path)):
            raise OSError(f"could not write {path}")
        written.append(path)

    def open_window(url: str, store: ConversationStore | None = None) -> QtChatWindow:
        window = QtChatWindow(url, store=store, options={"max_tokens": 1000})
        window.resize(1100, 720)
        window.move(30, 30)
        window.show()
        qt_wait(app, lambda: window.fleet is not None, 20, "the window's first look at the fleet")
        return window

    def ask(window: QtChatWindow, question: str) -> None:
        window.input.setText(question)
        window.send()
        qt_wait(app, lambda: not window.streaming, 30, "the answer")

    store = ConversationStore(work / "chats")
    writer = ChatModel(clock=iter(range(1_780_000_000, 1_780_100_000, 3600)).__next__)
    keep(writer, store)
    for title, question, reply in SAVED:
        c = writer.new_conversation()
        writer.start_reply(c.id, question)
        writer.add_delta(c.id, reply, 0.0)
        writer.end_reply(c.id, DONE)
        writer.rename(c.id, title)

    models = {"smollm2-135m-instruct": CannedGenerator(MARKDOWN_ANSWER), "qwen2.5-0.5b-instruct": CannedGenerator("Hi")}
    with chat_api(**models) as url:
        window = open_window(url, store)
        ask(window, "How do I count the words in a text with Python?")
        window.transcript.anchorClicked.emit(QUrl("copy:1:0"))
        scroll = window.transcript.verticalScrollBar()
        scroll.setValue(0)
        save(window, NAMES[0])
        window.close()

        (work / "chats" / "20260301-090000-0badf0.json").write_text('{"format": 1, "title": "cut off')
        window = open_window(url, store)
        window.conversation_list.setCurrentRow(2)  # "Summarise the Q3 report", after the new chat and the latest
        save(window, NAMES[1])
        window.close()

    with chat_api(**{"smollm2-135m-instruct": PausedGenerator()}) as url:
        window = open_window(url)
        ask(window, "Are you there?")
        save(window, NAMES[2])
        window.close()

    window = open_window("http://127.0.0.1:9/v1")
    save(window, NAMES[3])
    window.close()
    platform = app.platformName()
    (out / "CHAT-PLATFORM.txt").write_text(platform + "\n")
    return written


def settle(app, seconds: float = 0.4) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        app.processEvents()
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Screenshots of the chat window against a real API on loopback.")
    parser.add_argument("--out", type=Path, required=True, help="folder the PNG files are written to")
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (the saved chats)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DESKFLEET_CHATS_DIR", str(args.work / "default-chats"))
    for path in take_chat_screenshots(args.out, args.work):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
