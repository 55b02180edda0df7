"""The audit log: one JSON line per request with who, when, which model and ring, the status, the
token counts and the duration — never the prompt or the answer — rotated by size; written by the
real API for requests made with the real `openai` client."""

from __future__ import annotations

import json
import stat

import openai
import pytest

from engine.api.audit import AuditLog, AuditRecord, StrangerTally, utc_stamp
from engine.trust.key_book import KeyBook
from tests.support.api_helpers import SETTINGS
from tests.support.key_helpers import ScriptedGenerator, serving

TIMEOUT = 30.0
SECRET_PROMPT = "the merger with Initech closes on Friday"
SECRET_ANSWER = "noted, quietly"
FIELDS = {"time", "key", "method", "path", "model", "ring", "status", "prompt_tokens", "completion_tokens",
          "duration_ms", "remote"}


def record(i: int = 0, key: str | None = "alice") -> AuditRecord:
    return AuditRecord(utc_stamp(1_780_000_000 + i), key, "POST", "/v1/chat/completions", "m", "r1", 200, 10, i,
                       1.5, "127.0.0.1")


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_are_json_with_every_field_and_a_utc_time(tmp_path):
    log = AuditLog.in_dir(tmp_path)
    log.write(record(1))
    log.write(record(2, key=None))
    log.close()
    got = lines(tmp_path / "audit.jsonl")
    assert [set(g) for g in got] == [FIELDS, FIELDS]
    assert got[0]["time"] == "2026-05-28T20:26:41.000Z" and got[1]["key"] is None
    assert stat.S_IMODE((tmp_path / "audit.jsonl").stat().st_mode) == 0o600


def test_rotated_by_size_keeping_a_bounded_number_of_files(tmp_path):
    size = len(record().line())
    log = AuditLog(tmp_path / "audit.jsonl", max_bytes=3 * size, keep=2)
    for i in range(10):
        log.write(record(i))
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    newest, previous, oldest = (lines(tmp_path / n) for n in ("audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"))
    assert [r["completion_tokens"] for r in oldest + previous + newest] == list(range(3, 10))  # 0-2 dropped
    assert all(p.stat().st_size <= 3 * size for p in tmp_path.iterdir())
    reopened = AuditLog(tmp_path / "audit.jsonl", max_bytes=3 * size, keep=2)  # a restart continues the file
    reopened.write(record(10))
    reopened.close()
    assert lines(tmp_path / "audit.jsonl")[-1]["completion_tokens"] == 10


def test_a_failing_disk_is_logged_once_and_does_not_raise(tmp_path, caplog):
    (tmp_path / "audit.jsonl").mkdir()  # cannot be opened as a file
    log = AuditLog.in_dir(tmp_path)
    log.write(record(1))
    log.write(record(2))
    assert caplog.text.count("cannot write the audit log") == 1


def test_the_api_audits_who_asked_and_how_much_never_the_text(tmp_path):
    book = KeyBook(tmp_path)
    alice = book.issue("alice")
    audit = AuditLog.in_dir(tmp_path)
    with serving(ScriptedGenerator(SECRET_ANSWER), SETTINGS, keys=book, audit=audit) as url:
        with openai.OpenAI(base_url=url, api_key=alice.secret, max_retries=0, timeout=TIMEOUT) as client:
            messages = [{"role": "user", "content": SECRET_PROMPT[:12]}]
            plain = client.chat.completions.create(model="fake", messages=messages, max_tokens=30)
            assert plain.choices[0].message.content == SECRET_ANSWER
            streamed = client.completions.create(model="fake", prompt=SECRET_PROMPT[:20], max_tokens=5, stream=True)
            assert "".join(c.choices[0].text for c in streamed if c.choices) == SECRET_ANSWER[:5]
            client.models.list()
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(model="no-such-model", messages=messages)
        with openai.OpenAI(base_url=url, api_key="sk-deskfleet-stolen", max_retries=0, timeout=TIMEOUT) as thief:
            with pytest.raises(openai.AuthenticationError):
                thief.chat.completions.create(model="fake", messages=messages)
        import urllib.request
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=TIMEOUT) as r:
            assert r.status == 200
    audit.close()
    text = (tmp_path / "audit.jsonl").read_text()
    assert SECRET_PROMPT[:12] not in text and SECRET_ANSWER[:5] not in text and alice.secret not in text
    got = lines(tmp_path / "audit.jsonl")
    assert [(g["key"], g.get("method"), g.get("path"), g.get("status")) for g in got] == [
        ("alice", "POST", "/v1/chat/completions", 200),
        ("alice", "POST", "/v1/completions", 200),
        ("alice", "GET", "/v1/models", 200),
        ("alice", "POST", "/v1/chat/completions", 404),
        (None, None, None, None),  # the stranger: counted in a summary, written when the API stopped
    ]  # /health is not audited
    assert got[-1]["kind"] == "strangers" and got[-1]["refused"] == [{"remote": "127.0.0.1", "status": 401,
                                                                      "requests": 1}]
    got = got[:-1]
    chat, text_completion, _, unknown = got
    assert chat["model"] == "fake" and chat["ring"] == "default"
    assert chat["prompt_tokens"] == len(f"<user>{SECRET_PROMPT[:12]}<assistant>")
    assert chat["completion_tokens"] == plain.usage.completion_tokens == len(SECRET_ANSWER) + 1  # + EOS
    assert text_completion["prompt_tokens"] == 20 and text_completion["completion_tokens"] == 5
    assert unknown["model"] == "no-such-model" and unknown["ring"] is None
    assert all(g["duration_ms"] >= 0 and g["remote"] == "127.0.0.1" for g in got)


def test_strangers_are_counted_into_one_bounded_summary_a_minute(tmp_path):
    now = [1_780_000_000.0]
    log = AuditLog(tmp_path / "audit.jsonl", stranger_interval_s=60.0, clock=lambda: now[0])
    log.write(record(0))
    for i in range(5000):
        log.refused(f"10.0.{i % 50}.1", 401)
        log.refused("10.9.9.9", 421)
    now[0] += 61
    log.refused("10.0.0.1", 401)  # the next minute's first stranger: the last minute's summary is written
    log.write(record(1))
    log.close()
    got = lines(tmp_path / "audit.jsonl")
    assert [g.get("kind", g["key"]) for g in got] == ["alice", "strangers", "alice", "strangers"]
    minute = got[1]
    assert minute["time"] == "2026-05-28T20:26:40.000Z" and minute["interval_s"] == 60.0
    assert minute["refused"][0] == {"remote": "10.9.9.9", "status": 421, "requests": 5000}
    assert len(minute["refused"]) == 32 and minute["other_addresses"] == 51 - 32
    assert sum(r["requests"] for r in minute["refused"]) + minute["other_requests"] == 10_000
    assert got[3]["refused"] == [{"remote": "10.0.0.1", "status": 401, "requests": 1}]
    assert len(got[1]) == len(got[3]) and all(len(json.dumps(g)) < 4096 for g in got)


def test_the_tally_of_one_minute_is_bounded_in_memory():
    tally = StrangerTally(table=100, named=10)
    for i in range(1000):
        tally.count(f"fd00::{i:x}", 401, 0.0)
    assert not tally.due(59.9) and tally.due(60.0)
    summary = tally.take()
    assert summary is not None and len(summary.refused) == 10
    assert summary.other_addresses == 990 and summary.other_requests == 990
    assert tally.take() is None
