"""Reusable join tokens: a token of N uses admits at most N PCs, also under concurrent joins over
the real enrolment endpoint and across processes sharing the book; expiry, revocation and
auto-approval (which must expire) as the book decides them; a format-1 book still reads."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys

import pytest

from engine.control.enrollment import EnrollmentServer, async_join
from engine.control.join_audit import JoinAudit
from engine.errors import JoinRefused, TokenBookError, TokenPolicyError
from engine.state.db import DB_FILE, StateDB
from engine.state.legacy import BACKUP_DIR
from engine.trust.fleet_ca import FleetAuthority, Role
from engine.trust.join_token import JoinToken, TokenBook
from tests.support.asyncutil import run

USES = 3
JOINS = 12
PROCESSES = 12


class Clock:
    def __init__(self) -> None:
        self.now = 2_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def authority():
    return FleetAuthority.create("tokens")


def test_a_token_of_three_uses_admits_exactly_three_of_twelve_concurrent_joins(authority, tmp_path):
    book = TokenBook(tmp_path / "tokens.json", authority.fingerprint)
    audit = JoinAudit(tmp_path / "audit.jsonl")
    console = authority.issue_credentials("console", role=Role.CONSOLE)
    joined: list[str] = []
    server = EnrollmentServer(authority, book, console, audit=audit,
                              on_join=lambda node, name, info: joined.append(node))
    issued = book.issue_token(uses=USES, label="lab")

    async def main():
        host, port = await server.async_start("127.0.0.1", 0)
        try:
            return await asyncio.gather(*(async_join(f"{host}:{port}", issued.text, f"pc-{i}") for i in range(JOINS)),
                                        return_exceptions=True)
        finally:
            await server.async_close()

    outcomes = run(main(), 180)
    admitted = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, JoinRefused)]
    assert len(admitted) == USES and len(refused) == JOINS - USES, outcomes
    assert {r.reason for r in refused} == {"used"}
    nodes = {a.credentials.node_id for a in admitted}
    assert set(joined) == nodes
    [info] = book.tokens()
    assert (info.used, info.uses_left, info.state) == (USES, 0, "used_up")
    assert {a.node_id for a in info.admitted} == nodes
    lines = audit.lines()
    assert {(x["event"], x["node_id"], x["token_id"], x["token_label"]) for x in lines
            if x["event"] == "admitted"} == {("admitted", n, info.token_id, "lab") for n in nodes}
    refusals = [x for x in lines if x["event"] == "refused"]  # the nine late joins are audited too
    assert len(refusals) == JOINS - USES and {(x["reason"], x["token_id"]) for x in refusals} == \
        {("used", info.token_id)}
    assert info.token_id not in issued.text and info.token_id == issued.info.token_id


def _redeem_in_child(path: str, fingerprint: str, token: str, results, barrier) -> None:
    barrier.wait(30)  # all at once: without the book's lock most of them would take a use
    try:
        TokenBook(path, fingerprint).redeem(token)
        results.put("admitted")
    except JoinRefused as exc:
        results.put(exc.reason)


@pytest.mark.skipif(sys.platform == "win32", reason="the cross-process lock is POSIX flock")
def test_processes_sharing_the_book_never_take_more_uses_than_the_token_has(authority, tmp_path):
    path = tmp_path / "tokens.json"
    token = TokenBook(path, authority.fingerprint).issue_token(uses=2).text
    ctx = multiprocessing.get_context("fork")
    results, barrier = ctx.Queue(), ctx.Barrier(PROCESSES)
    children = [ctx.Process(target=_redeem_in_child, args=(str(path), authority.fingerprint, token, results, barrier))
                for _ in range(PROCESSES)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    outcomes = sorted(results.get(timeout=10) for _ in children)
    assert outcomes == ["admitted"] * 2 + ["used"] * (PROCESSES - 2)
    assert TokenBook(path, authority.fingerprint).tokens()[0].used == 2


def test_expiry_revocation_and_the_listing(authority, tmp_path):
    clock = Clock()
    book = TokenBook(tmp_path / "tokens.json", authority.fingerprint, clock=clock)
    forever = book.issue_token(uses=5, ttl_s=None, label="  lab   bench ")
    hour = book.issue_token(uses=2, ttl_s=3600, auto_approve=True)
    assert forever.info.label == "lab bench" and forever.info.expires_at is None
    book.redeem(forever.text)
    clock.now += 3601
    with pytest.raises(JoinRefused) as expired:
        book.redeem(hour.text)
    assert expired.value.reason == "expired"
    clock.now += 10 * 365 * 86400  # a token without expiry still admits ten years on
    assert book.redeem(forever.text).token_id == forever.info.token_id
    assert book.revoke(forever.info.token_id).state == "revoked"
    with pytest.raises(JoinRefused) as revoked:
        book.redeem(forever.text)
    assert revoked.value.reason == "revoked" and "revoked" in str(revoked.value)
    listing = {t.token_id: t for t in book.tokens()}
    assert (listing[forever.info.token_id].used, listing[forever.info.token_id].uses_left) == (2, 0)
    assert book.outstanding() == 0
    with pytest.raises(TokenPolicyError, match="no join token"):
        book.revoke("0000000000")
    assert book.tokens()[0].to_json()["id"] == book.tokens()[0].token_id


def test_what_the_book_will_not_issue_is_a_named_error_and_nothing_is_written(authority, tmp_path):
    path = tmp_path / "tokens.json"
    book = TokenBook(path, authority.fingerprint)
    for kwargs, words in (({"auto_approve": True, "ttl_s": None}, "must expire"), ({"uses": 0}, "1 to"),
                          ({"uses": True}, "1 to"), ({"ttl_s": 0}, "positive"), ({"ttl_s": -1.0}, "positive"),
                          ({"label": "x" * 81}, "label"), ({"label": "a\x00b"}, "label")):
        with pytest.raises(TokenPolicyError, match=words):
            book.issue_token(**kwargs)
    assert not path.exists()


def test_admissions_are_remembered_per_token_and_the_newest_wins(authority, tmp_path):
    clock = Clock()
    book = TokenBook(tmp_path / "tokens.json", authority.fingerprint, clock=clock)
    first = book.issue_token(uses=2)
    clock.now += 1
    second = book.issue_token(auto_approve=True)
    book.record_admission(book.redeem(first.text).token_id, "n" * 64, "pc-1")
    book.record_admission(book.redeem(second.text).token_id, "n" * 64, "pc-1")  # joined again
    assert book.admitted_by("n" * 64).token_id == second.info.token_id
    assert book.admitted_by("m" * 64) is None
    for i in range(3):
        book.record_admission(first.info.token_id, f"{i}" * 64, f"pc-{i}")
    listed = next(t for t in book.tokens() if t.token_id == first.info.token_id)
    short = listed.to_json(admitted_limit=2)
    assert short["admitted_count"] == 4 and [a["name"] for a in short["admitted"]] == ["pc-1", "pc-2"]
    assert len(listed.to_json()["admitted"]) == 4


def test_a_format_1_book_from_before_the_database_is_imported_once_and_kept_as_a_backup(authority, tmp_path):
    clock = Clock()
    path = tmp_path / "join-tokens.json"
    fresh, spent = JoinToken.new(authority.fingerprint), JoinToken.new(authority.fingerprint)
    text = json.dumps({"format": "deskfleet-join-tokens/1", "tokens": {
        fresh.secret_hash: {"issued_at": clock.now, "expires_at": clock.now + 60, "used_at": None},
        spent.secret_hash: {"issued_at": clock.now, "expires_at": clock.now + 60, "used_at": clock.now}}})
    path.write_text(text)
    book = TokenBook(path, authority.fingerprint, clock=clock)
    assert {t.state for t in book.tokens()} == {"active", "used_up"}
    with pytest.raises(JoinRefused) as used:
        book.redeem(spent.text)
    assert used.value.reason == "used"
    book.redeem(fresh.text)
    assert all(t.uses == 1 and t.used == 1 for t in book.tokens())
    assert not path.exists() and (tmp_path / BACKUP_DIR / path.name).read_text() == text
    assert (tmp_path / DB_FILE).is_file()


def test_a_damaged_book_from_before_the_database_stops_the_import_and_is_left_in_place(authority, tmp_path):
    path = tmp_path / "join-tokens.json"
    damaged = json.dumps({"format": "deskfleet-join-tokens/2", "tokens": {"a" * 64: {"uses": 1}}})
    path.write_text(damaged)
    with pytest.raises(TokenBookError, match=f"{path.name}.*damaged"):
        TokenBook(path, authority.fingerprint).tokens()
    assert path.read_text() == damaged and not (tmp_path / BACKUP_DIR).exists()
    path.unlink()  # moved aside: the next open starts an empty book
    StateDB.forget(tmp_path)
    assert TokenBook(path, authority.fingerprint).tokens() == ()


def test_two_books_on_one_file_see_each_others_writes(authority, tmp_path):
    """Two books on one state dir share its database: each sees the other's writes at once."""
    path = tmp_path / "tokens.json"
    first, second = TokenBook(path, authority.fingerprint), TokenBook(path, authority.fingerprint)
    issued = first.issue_token(uses=2)
    assert second.tokens()[0].used == 0
    second.redeem(issued.text)
    assert first.tokens()[0].used == 1
    first.redeem(issued.text)
    with pytest.raises(JoinRefused):
        second.redeem(issued.text)
    assert [t.used for t in first.tokens()] == [t.used for t in second.tokens()] == [2]


def test_joins_refused_for_a_known_token_are_audited_and_a_replayed_one_only_up_to_a_bound(authority, tmp_path,
                                                                                           monkeypatch):
    """Issue 29, L12: a leaked token (revoked, used up or expired) leaves an audit line naming it and
    the address it came from; a token the book does not know (a stranger's guess) leaves none, and a
    known one replayed in a loop writes at most REFUSALS_AUDITED lines per window."""
    from engine.control import enrollment

    monkeypatch.setattr(enrollment, "REFUSALS_AUDITED", 3)
    clock = Clock()
    book = TokenBook(tmp_path / "tokens.json", authority.fingerprint, clock=clock)
    audit = JoinAudit(tmp_path / "audit.jsonl")
    server = EnrollmentServer(authority, book, authority.issue_credentials("console", role=Role.CONSOLE), audit=audit)
    revoked = book.issue_token(label="lost laptop")
    book.revoke(revoked.info.token_id)
    expired = book.issue_token(ttl_s=60, label="yesterday")
    used = book.issue_token(label="once")
    stranger = JoinToken.new(authority.fingerprint).text  # well-formed, this fleet's pin, never issued

    async def main():
        host, port = await server.async_start("127.0.0.1", 0)
        address = f"{host}:{port}"
        try:
            await async_join(address, used.text, "pc-first")
            clock.now += 120
            outcomes = []
            for text in (revoked.text, expired.text, used.text, *(revoked.text,) * 5, stranger, stranger):
                outcomes.append(await asyncio.gather(async_join(address, text, "pc-x"), return_exceptions=True))
            return outcomes
        finally:
            await server.async_close()

    outcomes = [o for [o] in run(main(), 120)]
    assert all(isinstance(o, JoinRefused) for o in outcomes), outcomes
    refusals = [x for x in audit.lines() if x["event"] == "refused"]
    assert [(x["token_id"], x["reason"], x["token_label"]) for x in refusals] == [
        (revoked.info.token_id, "revoked", "lost laptop"), (expired.info.token_id, "expired", "yesterday"),
        (used.info.token_id, "used", "once"), (revoked.info.token_id, "revoked", "lost laptop"),
        (revoked.info.token_id, "revoked", "lost laptop")]  # 3 per token per window: the other 3 held back
    assert all(x["remote"] == "127.0.0.1" and x["node_id"] == "" and x["name"] == "pc-x" for x in refusals)
    assert len(audit.lines()) == 1 + len(refusals)  # the admission, the refusals: the stranger left no line
