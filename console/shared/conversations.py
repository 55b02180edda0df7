"""The chats a person had with the fleet, kept on disk per user: one JSON file per conversation.

Where: ``$DESKFLEET_CHATS_DIR`` when set, else the user's data directory
(``$XDG_DATA_HOME/deskfleet/chats``, ``%LOCALAPPDATA%\\Deskfleet\\chats``), so the console and
the tray of one person share their chats, and another person on the same PC sees none of them.
Each write replaces the file atomically (a crash leaves the old or the new one). A file that
cannot be read is reported (:attr:`Listing.damaged`) and left exactly as it is: nothing here
overwrites or deletes it, so a person (or support) can still recover its text. Two windows open
on the same chat at once: the last one to finish a reply wins that file.

The store is the I/O edge; :class:`console.shared.chat_model.ChatModel` is the state. ``keep``
wires one to the other: it loads the listing into the model and saves a conversation whenever
the model says it changed (a message added, a reply ended, a rename), and deletes its file when
the model drops it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from console.shared.chat_model import (
    DONE,
    FAILED,
    STOPPED,
    STREAMING,
    ChatError,
    ChatEvent,
    ChatEventKind,
    ChatModel,
    Conversation,
    Message,
)
from engine.atomic_file import write_json_atomic

CHATS_DIR_ENV = "DESKFLEET_CHATS_DIR"
FORMAT = 1
ROLES = ("user", "assistant", "system")
STATES = (DONE, STOPPED, FAILED)
ID_PATTERN = re.compile(r"^[0-9]{8}-[0-9]{6}-[0-9a-f]{6}$")


class ConversationStoreError(ChatError):
    """Raised when a conversation cannot be written or deleted (disk full, no permission), or an id
    that is not one of the store's is asked for; the message names the file."""


def default_chats_dir() -> Path:
    """``$DESKFLEET_CHATS_DIR``, else this user's data directory's ``chats`` folder."""
    if env := os.environ.get(CHATS_DIR_ENV):
        return Path(env)
    if os.name == "nt":
        return Path(os.environ.get("LOCALAPPDATA", Path.home())) / "Deskfleet" / "chats"
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "deskfleet" / "chats"


@dataclass(frozen=True)
class Damaged:
    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path.name}: {self.reason}"


@dataclass(frozen=True)
class Listing:
    conversations: tuple[Conversation, ...]  # newest (last changed) first
    damaged: tuple[Damaged, ...]  # files that could not be read; kept as they are


def to_json(conversation: Conversation) -> dict[str, Any]:
    """What is written: a reply still streaming is left out (it is saved when it ends)."""
    messages = [m for m in conversation.messages if m.state != STREAMING]
    return {"format": FORMAT, "id": conversation.id, "title": conversation.title,
            "created": conversation.created, "updated": conversation.updated, "model": conversation.model,
            "messages": [{"role": m.role, "content": m.content, "state": m.state,
                          **({"error": m.error} if m.error else {}),
                          **({"reasoning": m.reasoning} if m.reasoning else {})} for m in messages]}


def from_json(doc: Any) -> Conversation:
    """A conversation from its file's JSON; ValueError saying what is wrong."""
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if doc.get("format") != FORMAT:
        raise ValueError(f"format {doc.get('format')!r}, this version reads format {FORMAT}")
    cid, title = doc.get("id"), doc.get("title")
    if not isinstance(cid, str) or not ID_PATTERN.match(cid):
        raise ValueError(f"bad id {cid!r}")
    if not isinstance(title, str):
        raise ValueError("no title")
    created, updated = doc.get("created"), doc.get("updated")
    if not all(isinstance(t, int | float) and not isinstance(t, bool) for t in (created, updated)):
        raise ValueError("bad created/updated times")
    assert isinstance(created, int | float) and isinstance(updated, int | float)  # checked just above
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError("bad model name")
    raw = doc.get("messages")
    if not isinstance(raw, list):
        raise ValueError("no message list")
    messages = []
    for n, m in enumerate(raw):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                and m.get("state", DONE) in STATES and isinstance(m.get("error") or "", str)
                and isinstance(m.get("reasoning") or "", str)):
            raise ValueError(f"message {n + 1} is malformed")
        messages.append(Message(m["role"], m["content"], m.get("state", DONE), m.get("error"),
                                reasoning=m.get("reasoning") or ""))
    return Conversation(cid, title, messages, created=float(created), updated=float(updated), model=model)


class ConversationStore:
    """One user's saved chats in ``root`` (default: :func:`default_chats_dir`)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else default_chats_dir()

    def path(self, conversation_id: str) -> Path:
        if not ID_PATTERN.match(conversation_id):
            raise ConversationStoreError(f"{conversation_id!r} is not a saved conversation's id")
        return self.root / f"{conversation_id}.json"

    def list(self) -> Listing:
        """Every readable conversation, newest first, and the files that could not be read."""
        good: list[Conversation] = []
        damaged: list[Damaged] = []
        try:
            paths = sorted(p for p in self.root.iterdir() if p.suffix == ".json" and not p.name.startswith("."))
        except FileNotFoundError:
            return Listing((), ())
        except OSError as exc:
            return Listing((), (Damaged(self.root, f"the folder cannot be read ({exc.strerror or exc})"),))
        for path in paths:
            try:
                conversation = from_json(json.loads(path.read_text(encoding="utf-8")))
                if path.stem != conversation.id:
                    raise ValueError(f"its id {conversation.id!r} is not its file name")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
                damaged.append(Damaged(path, _reason(exc)))
                continue
            good.append(conversation)
        good.sort(key=lambda c: (c.updated, c.id), reverse=True)
        return Listing(tuple(good), tuple(damaged))

    def save(self, conversation: Conversation) -> None:
        path = self.path(conversation.id)
        try:
            write_json_atomic(path, to_json(conversation), dir_mode=0o700)
        except OSError as exc:
            raise ConversationStoreError(f"could not save the chat {conversation.title!r} to {path} "
                                         f"({exc.strerror or exc}); check the disk and the folder's "
                                         "permissions") from exc

    def delete(self, conversation_id: str) -> None:
        path = self.path(conversation_id)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise ConversationStoreError(f"could not delete {path} ({exc.strerror or exc})") from exc


def _reason(exc: BaseException) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"not JSON (line {exc.lineno}: {exc.msg})"
    if isinstance(exc, UnicodeDecodeError):
        return "not UTF-8 text"
    if isinstance(exc, OSError):
        return f"cannot be read ({exc.strerror or exc})"
    return str(exc)


# the changes after which a conversation is saved again
SAVED_ON = frozenset({ChatEventKind.MESSAGE, ChatEventKind.ENDED, ChatEventKind.RENAMED})


def keep(model: ChatModel, store: ConversationStore,
         on_error: Callable[[ConversationStoreError], None] | None = None) -> Listing:
    """Load ``store``'s conversations into ``model`` (oldest last) and save each change from now
    on; ``on_error(ConversationStoreError)`` hears of a failed write (default: raise it). Returns
    the listing (its ``damaged`` files are for the view to report)."""
    listing = store.list()
    model.load(listing.conversations)

    def on_event(event: ChatEvent) -> None:
        try:
            if event.kind in SAVED_ON and event.conversation_id is not None:
                conversation = model.get(event.conversation_id)
                if any(m.role != "system" for m in conversation.messages):  # an empty "New chat" stays unsaved
                    store.save(conversation)
            elif event.kind is ChatEventKind.REMOVED and event.conversation_id is not None:
                store.delete(event.conversation_id)
        except ConversationStoreError as exc:
            if on_error is None:
                raise
            on_error(exc)

    model.subscribe(on_event)
    return listing

