"""Usage per request and token budgets, on the real API with the real `openai` client and the real
state database: every completion is a row (key, model, tokens, time to first token, status; never
the text), added up by key, model and day through `deskfleet usage` and the admin API; a key or a
group over its daily budget is refused with 429, the reset time and Retry-After, and warned from
80 %; the rows' growth is bounded by the retention."""

from __future__ import annotations

import datetime as dt
import json
import re

import openai
import pytest

from engine.api.keys import Caller
from engine.api.usage import WARNING_HEADER, Budget, UsageLedger, judge, parse_since, resets_at
from engine.cli.main import main
from engine.state.db import DB_FILE, StateDB
from engine.trust.key_book import KeyBook
from tests.fleet_service.admin import Admin
from tests.fleet_service.conftest import service_in_process
from tests.support.api_helpers import SETTINGS
from tests.support.asyncutil import run
from tests.support.key_helpers import ScriptedGenerator, serving

TIMEOUT = 30.0
SECRET_WORDS = "my PIN is 4711"
CHAT = [{"role": "user", "content": SECRET_WORDS}]
PER_REQUEST = 14 + 4  # the ByteTokenizer's prompt of CHAT (14 bytes + its template's 0) + max_tokens=4


def _ask(client: openai.OpenAI, **kw):
    return client.chat.completions.with_raw_response.create(model="fake", messages=CHAT, max_tokens=4, **kw)


def test_every_request_is_a_usage_row_without_its_text_added_up_by_key_model_and_day(tmp_path, capsys):
    book = KeyBook(tmp_path)
    alice = book.issue("alice", holder="Alice Martin", group="finance")
    wiki = book.issue("wiki-bot", holder="Wiki", holder_kind="application")
    with serving(ScriptedGenerator(), SETTINGS, keys=book) as url:
        with openai.OpenAI(base_url=url, api_key=alice.secret, max_retries=0, timeout=TIMEOUT) as client:
            first = _ask(client).parse()
            _ask(client).parse()
            with client.chat.completions.create(model="fake", messages=CHAT, max_tokens=4, stream=True) as stream:
                assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        with openai.OpenAI(base_url=url, api_key=wiki.secret, max_retries=0, timeout=TIMEOUT) as client:
            _ask(client).parse()
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(model="fake", messages=CHAT, max_tokens=9999)
    per_request = first.usage.total_tokens
    rows = {r.value: r for r in StateDB.for_dir(tmp_path).usage_summary("key", 0.0)}
    assert (rows["alice"].requests, rows["alice"].errors) == (3, 0)
    assert rows["alice"].prompt_tokens + rows["alice"].completion_tokens == 3 * per_request
    assert rows["alice"].mean_ttft_ms is not None and rows["alice"].mean_duration_ms > 0
    assert (rows["wiki-bot"].requests, rows["wiki-bot"].errors, rows["wiki-bot"].completion_tokens) == (2, 1, 4)
    stored = b"".join(p.read_bytes() for p in tmp_path.glob(f"{DB_FILE}*"))
    assert SECRET_WORDS.encode() not in stored  # never the text

    assert main(["usage", "--state-dir", str(tmp_path), "--by", "model", "--json"]) == 0
    by_model = json.loads(capsys.readouterr().out)
    assert [(r["value"], r["requests"]) for r in by_model["rows"]] == [("fake", 5)]
    assert main(["usage", "--state-dir", str(tmp_path), "--by", "day", "--since", "1d"]) == 0
    table = capsys.readouterr().out
    assert dt.datetime.now(dt.UTC).strftime("%Y-%m-%d") in table and "REQUESTS" in table
    assert main(["usage", "--state-dir", str(tmp_path), "--key", "wiki-bot", "--json"]) == 0
    assert [r["value"] for r in json.loads(capsys.readouterr().out)["rows"]] == ["wiki-bot"]
    assert main(["usage", "--state-dir", str(tmp_path), "--since", "last tuesday"]) == 1


def test_a_key_over_its_daily_budget_gets_429_with_the_reset_time_and_a_warning_before(tmp_path):
    book = KeyBook(tmp_path)
    alice = book.issue("alice")
    with serving(ScriptedGenerator(), SETTINGS, keys=book) as url:
        with openai.OpenAI(base_url=url, api_key=alice.secret, max_retries=0, timeout=TIMEOUT) as client:
            per_request = _ask(client).parse().usage.total_tokens
            book.update("alice", day_tokens=4 * per_request + per_request // 2)  # 4.5 requests a day
            answers = [_ask(client) for _ in range(4)]  # each starts with 1, 2, 3, 4 of 4.5 used (the last 88 %)
            assert [WARNING_HEADER in a.headers for a in answers] == [False, False, False, True]
            warning = answers[-1].headers[WARNING_HEADER]
            assert re.fullmatch(r"8\d% of the daily budget of the key 'alice' \(\d+ tokens\) used; it resets at "
                                r"\d{4}-\d\d-\d\dT00:00:00Z", warning), warning
            with pytest.raises(openai.RateLimitError) as refused:
                _ask(client)
    tomorrow = (dt.datetime.now(dt.UTC) + dt.timedelta(days=1)).strftime("%Y-%m-%dT00:00:00Z")
    assert refused.value.code == "budget_exceeded"
    assert "daily budget" in refused.value.message and tomorrow in refused.value.message
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 86400


def test_a_groups_budget_is_shared_by_its_keys(tmp_path):
    book = KeyBook(tmp_path)
    bob, carol = book.issue("bob", group="lab"), book.issue("carol", group="lab")
    outsider = book.issue("dave")
    with serving(ScriptedGenerator(), SETTINGS, keys=book) as url:
        clients = {name: openai.OpenAI(base_url=url, api_key=key.secret, max_retries=0, timeout=TIMEOUT)
                   for name, key in (("bob", bob), ("carol", carol), ("dave", outsider))}
        per_request = _ask(clients["dave"]).parse().usage.total_tokens
        book.set_group_budget("lab", day_tokens=2 * per_request, month_tokens=None)
        _ask(clients["bob"])
        _ask(clients["carol"])
        with pytest.raises(openai.RateLimitError) as refused:
            _ask(clients["bob"])
        assert "the group 'lab'" in refused.value.message and refused.value.code == "budget_exceeded"
        _ask(clients["dave"])  # not in the group
        for client in clients.values():
            client.close()
    assert book.groups() == {"lab": {"day_tokens": 2 * per_request, "month_tokens": None}}


def test_budgets_judged_and_reset_at_utc_midnight_and_the_first_of_the_month():
    now = dt.datetime(2026, 12, 31, 22, 0, tzinfo=dt.UTC)
    assert resets_at("day", now) == dt.datetime(2027, 1, 1, tzinfo=dt.UTC) == resets_at("month", now)
    assert resets_at("month", dt.datetime(2026, 2, 10, tzinfo=dt.UTC)) == dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
    day = Budget("key", "a", "day", 100, 85, resets_at("day", now))
    month = Budget("group", "g", "month", 1000, 1000, resets_at("month", now))
    assert judge([day]).warning == day and judge([day]).over is None
    assert judge([day, month]).over == month and judge([Budget("key", "a", "day", 100, 79, now)]) == judge([])
    assert "the monthly budget of the group 'g' (1000 tokens) is used up" in month.refusal()
    assert parse_since("2d", now=1000000.0) == 1000000.0 - 2 * 86400
    assert parse_since("2026-12-01") == dt.datetime(2026, 12, 1, tzinfo=dt.UTC).timestamp()


def test_usage_rows_are_folded_into_days_and_dropped_after_the_retention(tmp_path):
    day0 = dt.datetime(2026, 11, 1, 12, tzinfo=dt.UTC).timestamp()
    clock = [day0]
    db = StateDB.for_dir(tmp_path)
    ledger = UsageLedger(lambda: db, raw_days=3, daily_days=10, clock=lambda: clock[0])
    alice = Caller("alice", group="lab")
    for day in range(30):
        for hour in range(4):  # four requests a day, two models
            clock[0] = day0 + day * 86400 + hour * 600
            ledger.record(alice, model=f"m{hour % 2}", ring="r1", prompt_tokens=10, completion_tokens=5,
                          ttft_s=0.1, duration_s=0.5, status=200)
    before = {r.value: r.requests for r in db.usage_summary("day", 0.0)}
    assert db.usage_count() == (120, 0) and len(before) == 30
    assert ledger.roll_up() == 120 - 4 * 4  # all but today's and the three days before folded
    raw, daily = db.usage_count()
    assert raw == 16 and daily == 2 * 7  # days 19-25 kept as days (ten before today), two models a day
    after = db.usage_summary("day", 0.0)
    assert len(after) == 11 and all(r.requests == 4 and r.prompt_tokens == 40 for r in after)
    assert after[0].mean_ttft_ms == pytest.approx(100.0) and after[-1].mean_ttft_ms == pytest.approx(100.0)
    by_model = {r.value: r.requests for r in db.usage_summary("model", 0.0)}
    assert by_model == {"m0": 22, "m1": 22}
    # another month of traffic: the totals the budgets read keep only today's and this month's periods
    for day in range(30, 60):
        clock[0] = day0 + day * 86400
        ledger.record(alice, model="m0", ring="r1", prompt_tokens=1, completion_tokens=1, ttft_s=None,
                      duration_s=0.1, status=200)
    ledger.roll_up()
    assert db.usage_count()[0] <= 4 and db.usage_count()[1] <= 10 * 2
    this_month = dt.datetime.fromtimestamp(clock[0], dt.UTC).strftime("%Y-%m")
    assert db.tokens_used("key:alice", "2026-11-01") == 0  # a day's total goes the day after it ended
    assert db.tokens_used("group:lab", this_month) > 0 and db.tokens_used("group:lab", "2026-11") > 0  # months: 2


def test_the_admin_api_adds_usage_up(tmp_path):
    state = tmp_path / "fleet"

    async def main_():
        async with service_in_process(state) as service, Admin.unix(state / "admin.sock") as a:
            ledger = UsageLedger(lambda: service.host.keys.db)
            for name, model in (("alice", "m1"), ("alice", "m2"), ("bob", "m1")):
                ledger.record(Caller(name), model=model, ring="r1", prompt_tokens=7, completion_tokens=3,
                              ttft_s=0.05, duration_s=0.2, status=200)
            by_key = await a.ok("GET", "/usage?by=key&since=1h")
            by_model = await a.ok("GET", "/usage?by=model&key=alice")
            status, refused = await a.call("GET", "/usage?by=colour")
            issued = await a.ok("POST", "/keys", {"name": "erin", "holder": "Erin", "group": "lab",
                                                  "day_tokens": 1000})
            changed = await a.ok("POST", "/keys/erin", {"month_tokens": 20000, "holder_kind": "application"})
            groups = await a.ok("POST", "/key-groups/lab", {"day_tokens": 5000})
        return by_key, by_model, status, refused, issued, changed, groups

    by_key, by_model, status, refused, issued, changed, groups = run(main_(), 120)
    assert [(r["value"], r["requests"], r["total_tokens"]) for r in by_key["rows"]] == [("alice", 2, 20),
                                                                                       ("bob", 1, 10)]
    assert [r["value"] for r in by_model["rows"]] == ["m1", "m2"]
    assert status == 400 and "colour" in refused["error"]["message"]
    assert (issued["holder"], issued["group"], issued["day_tokens"]) == ("Erin", "lab", 1000)
    assert changed["key"]["month_tokens"] == 20000 and changed["key"]["holder_kind"] == "application"
    assert groups["groups"] == {"lab": {"day_tokens": 5000, "month_tokens": None}}
