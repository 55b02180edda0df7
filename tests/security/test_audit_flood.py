"""Strangers cannot flush the audit trail (issue 29, M8).

The review sent 2,000 key-less requests in 1.86 s; each wrote a 360-byte audit line, so about
four minutes of them rotated every authenticated line out of the audit's six files. Here a
stranger floods the real API (the real aiohttp app on loopback, a real key book) whose audit is
small enough to rotate within the flood when strangers get a line each: a key holder's line made
before the flood is still there after it, and the flood is one summary line naming the address.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from engine.api.audit import AuditLog
from engine.trust.key_book import KeyBook
from tests.support.api_helpers import SETTINGS
from tests.support.asyncutil import run
from tests.support.key_helpers import ScriptedGenerator, serving

pytestmark = pytest.mark.slow

FLOOD = 1500
MAX_BYTES = 32 << 10  # two files of 32 KiB: ~180 stranger lines would rotate everything out


async def _flood(url: str) -> list[int]:
    statuses: list[int] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16)) as session:
        async def one(i: int) -> None:
            path = ("/v1/chat/completions", "/v1/models", f"/v1/nothing/{i}")[i % 3]
            async with session.post(url.removesuffix("/v1") + path, json={"model": "fake"},
                                    headers={"Authorization": f"Bearer sk-deskfleet-guess-{i}"}) as resp:
                statuses.append(resp.status)
                await resp.read()

        for start in range(0, FLOOD, 100):
            await asyncio.gather(*(one(i) for i in range(start, min(start + 100, FLOOD))))
    return statuses


def test_a_stranger_flood_does_not_rotate_the_authenticated_audit_out(tmp_path):
    book = KeyBook(tmp_path)
    alice = book.issue("alice")
    audit = AuditLog(tmp_path / "audit.jsonl", max_bytes=MAX_BYTES, keep=1)
    with serving(ScriptedGenerator("noted"), SETTINGS, keys=book, audit=audit) as url:
        with openai.OpenAI(base_url=url, api_key=alice.secret, max_retries=0, timeout=30) as client:
            client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        statuses = run(_flood(url), 120)
    audit.close()
    assert statuses.count(401) == FLOOD
    got = [json.loads(line) for name in ("audit.jsonl.1", "audit.jsonl") if (tmp_path / name).exists()
           for line in (tmp_path / name).read_text().splitlines()]
    assert [(g["key"], g["status"]) for g in got if g.get("kind") != "strangers"] == [("alice", 200)]
    summaries = [g for g in got if g.get("kind") == "strangers"]
    assert len(summaries) <= 2  # the flood may straddle a minute's end
    assert sum(r["requests"] for s in summaries for r in s["refused"]) == FLOOD
    assert {(r["remote"], r["status"]) for s in summaries for r in s["refused"]} == {("127.0.0.1", 401)}
