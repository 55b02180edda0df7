"""The chat's conversations on disk (console/shared/conversations.py) and the model's Regenerate,
rename and delete (console/shared/chat_model.py), without Qt: real files in the test's folder."""

from __future__ import annotations

import json
import os
import stat

import pytest

from console.shared.chat_model import DONE, FAILED, STOPPED, STREAMING, ChatError, ChatModel
from console.shared.conversations import (
    CHATS_DIR_ENV,
    ConversationStore,
    ConversationStoreError,
    default_chats_dir,
    keep,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1_780_000_000.0

    def __call__(self) -> float:
        self.now += 1
        return self.now


def answer(model: ChatModel, cid: str, question: str, reply: str, state: str = DONE) -> None:
    model.start_reply(cid, question)
    model.add_delta(cid, reply, 0.0)
    model.end_reply(cid, state)


def test_conversations_are_saved_on_each_change_and_listed_newest_first(tmp_path):
    store = ConversationStore(tmp_path / "chats")
    model = ChatModel(clock=Clock())
    assert keep(model, store).conversations == ()
    first = model.new_conversation()
    assert store.list().conversations == ()  # an empty new chat is not saved
    answer(model, first.id, "What is 2+2?", "4")
    second = model.new_conversation()
    answer(model, second.id, "Name a colour", "Blue")
    model.rename(first.id, "  Sums   for kids ")
    listing = store.list()
    assert [c.title for c in listing.conversations] == ["Name a colour", "Sums for kids"]  # a rename does not reorder
    assert listing.damaged == ()
    saved = listing.conversations[0]
    assert [(m.role, m.content, m.state) for m in saved.messages] == [("user", "Name a colour", DONE),
                                                                      ("assistant", "Blue", DONE)]
    # the time of the last message orders the list
    answer(model, first.id, "And 3+3?", "6")
    assert [c.id for c in store.list().conversations] == [first.id, second.id]
    answer(model, second.id, "Another", "Red")
    assert [c.id for c in store.list().conversations] == [second.id, first.id]
    if os.name == "posix":
        assert stat.S_IMODE((tmp_path / "chats").stat().st_mode) == 0o700
        assert not [p for p in (tmp_path / "chats").iterdir() if p.name.startswith(".")]  # no temporary left

    reopened = ChatModel()
    keep(reopened, store)
    assert [c.title for c in reopened.newest_first()] == ["Name a colour", "Sums for kids"]
    assert reopened.get(second.id).history()[-1] == {"role": "assistant", "content": "Red"}


def test_a_streaming_reply_is_not_saved_until_it_ends_and_a_stopped_one_keeps_its_text(tmp_path):
    store = ConversationStore(tmp_path)
    model = ChatModel()
    keep(model, store)
    c = model.new_conversation()
    model.start_reply(c.id, "Tell me a story")
    model.add_delta(c.id, "Once upon", 0.0)
    on_disk = json.loads(store.path(c.id).read_text())
    assert [m["role"] for m in on_disk["messages"]] == ["user"]
    model.end_reply(c.id, STOPPED)
    on_disk = json.loads(store.path(c.id).read_text())
    assert on_disk["messages"][-1] == {"role": "assistant", "content": "Once upon", "state": STOPPED}


def test_regenerate_replaces_the_last_answer_and_sends_the_same_question():
    model = ChatModel(system_prompt="Be brief.")
    c = model.new_conversation()
    with pytest.raises(ChatError, match="no finished answer"):
        model.regenerate(c.id)
    answer(model, c.id, "Capital of France?", "Lyon", FAILED)
    assert c.can_regenerate
    history = model.regenerate(c.id)
    assert history == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    assert [m.role for m in c.messages] == ["system", "user", "assistant"] and c.messages[-1].state == STREAMING
    assert not c.can_regenerate
    with pytest.raises(ChatError, match="no finished answer"):
        model.regenerate(c.id)  # not while it streams
    model.add_delta(c.id, "Paris", 0.0)
    model.end_reply(c.id, DONE)
    answer(model, c.id, "And Italy?", "Rome")
    history = model.regenerate(c.id)
    assert history[-3:] == [{"role": "user", "content": "Capital of France?"},
                            {"role": "assistant", "content": "Paris"}, {"role": "user", "content": "And Italy?"}]


def test_deleting_removes_the_file_and_moves_to_the_newest_other_chat(tmp_path):
    store = ConversationStore(tmp_path)
    model = ChatModel(clock=Clock())
    keep(model, store)
    a = model.new_conversation()
    answer(model, a.id, "a", "1")
    b = model.new_conversation()
    answer(model, b.id, "b", "2")
    model.start_reply(b.id, "again")
    with pytest.raises(ChatError, match="stop it first"):
        model.remove(b.id)
    model.end_reply(b.id, STOPPED)
    model.remove(b.id)
    assert not store.path(b.id).exists() and store.path(a.id).exists()
    assert model.current_id == a.id
    model.remove(a.id)
    assert store.list().conversations == ()
    assert model.current is not None and model.current.messages == []  # a fresh chat, unsaved
    with pytest.raises(ChatError, match="cannot be empty"):
        model.rename(model.current.id, "   ")


def test_a_damaged_file_is_reported_and_kept_as_it_is(tmp_path):
    store = ConversationStore(tmp_path)
    model = ChatModel()
    keep(model, store)
    good = model.new_conversation()
    answer(model, good.id, "hello", "hi")
    broken = tmp_path / "20260101-120000-abcdef.json"
    broken.write_text('{"format": 1, "id": "20260101-120000-abcdef", "title": "half')
    wrong = tmp_path / "20260101-120001-abcdef.json"
    wrong.write_text(json.dumps({"format": 1, "id": "20260101-120001-abcdef", "title": "t", "created": 1,
                                 "updated": 2, "messages": [{"role": "wizard", "content": "x"}]}))
    future = tmp_path / "20260101-120002-abcdef.json"
    future.write_text(json.dumps({"format": 7}))
    binary = tmp_path / "20260101-120003-abcdef.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    before = {p: p.read_bytes() for p in (broken, wrong, future, binary)}

    reopened = ChatModel()
    listing = keep(reopened, store)
    assert [c.id for c in listing.conversations] == [good.id]
    reasons = {d.path.name: d.reason for d in listing.damaged}
    assert reasons[broken.name].startswith("not JSON (line 1")
    assert reasons[wrong.name] == "message 1 is malformed"
    assert reasons[future.name] == "format 7, this version reads format 1"
    assert reasons[binary.name] == "not UTF-8 text"
    c = reopened.new_conversation()
    answer(reopened, c.id, "more", "text")
    assert {p: p.read_bytes() for p in before} == before  # nothing rewrote or removed them


def test_a_failed_write_is_reported_and_the_conversation_stays_in_memory(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the chats folder should be")
    store = ConversationStore(blocker)
    model = ChatModel()
    errors: list[ConversationStoreError] = []
    listing = keep(model, store, on_error=errors.append)
    assert listing.damaged and "cannot be read" in listing.damaged[0].reason
    c = model.new_conversation()
    answer(model, c.id, "hello", "hi")
    assert errors and f"could not save the chat 'hello' to {blocker}" in str(errors[0])
    assert model.get(c.id).messages[-1].content == "hi"
    with pytest.raises(ConversationStoreError, match="not a saved conversation's id"):
        store.path("../../etc/passwd")


def test_the_default_folder_is_per_user(monkeypatch, tmp_path):
    monkeypatch.delenv(CHATS_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    if os.name == "posix":
        assert default_chats_dir() == tmp_path / "data" / "deskfleet" / "chats"
    monkeypatch.setenv(CHATS_DIR_ENV, str(tmp_path / "elsewhere"))
    assert ConversationStore().root == tmp_path / "elsewhere"
