"""API keys: the key book in the state database (hashes only, shared between processes, damaged = loud),
the pure rate limiter, then the real `openai` client against the real API on loopback: no key, a
wrong key and a revoked key are 401, a key over its rate limit is 429 with Retry-After, and off
loopback the API is served only over TLS with the fleet CA."""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from engine.api.keys import Caller, KeyCheck, RateLimiter, retry_after_header
from engine.state.db import DB_FILE, StateDB
from engine.trust.key_book import KEY_PREFIX, KeyBook, KeyBookError, KeyNameError, digest
from tests.support.api_helpers import SETTINGS
from tests.support.key_helpers import ScriptedGenerator, serving
from tests.support.state_helpers import damage_key_record

TIMEOUT = 30.0
CHAT = [{"role": "user", "content": "hello"}]


# -- the book ------------------------------------------------------------------------------------

def test_issued_secret_is_kept_only_as_its_hash(tmp_path):
    book = KeyBook(tmp_path)
    issued = book.issue("alice", rpm=30)
    assert issued.secret.startswith(KEY_PREFIX) and len(issued.secret) == len(KEY_PREFIX) + 32
    stored = b"".join(p.read_bytes() for p in tmp_path.glob(f"{DB_FILE}*"))  # the database and its WAL
    assert issued.secret.encode() not in stored and digest(issued.secret).encode() in stored
    assert stat.S_IMODE(book.path.stat().st_mode) == 0o600
    assert book.identify(issued.secret).name == "alice"
    assert book.identify(issued.secret + "x") is None and book.identify("") is None
    assert [k.to_json() for k in book.keys()] == [{"name": "alice", "issued_at": issued.key.issued_at, "rpm": 30,
                                                  "tpm": None, "node_id": None, "revoked_at": None,
                                                  "metrics": False, "holder": None, "holder_kind": "person",
                                                  "group": None, "day_tokens": None, "month_tokens": None,
                                                  "priority": "interactive"}]
    assert "sha256" not in repr(issued) and issued.secret not in repr(issued)


def test_names_are_unique_among_live_keys_and_validated(tmp_path):
    book = KeyBook(tmp_path)
    first = book.issue("wiki-bot")
    with pytest.raises(KeyNameError, match="live key named 'wiki-bot' exists"):
        book.issue("wiki-bot")
    for bad in ("", "has space", "-dash-first", "x" * 65, "ünïcode"):
        with pytest.raises(KeyNameError, match="not allowed"):
            book.issue(bad)
    with pytest.raises(ValueError, match="rpm must be a whole number"):
        book.issue("limited", rpm=0)
    second = book.issue("wiki-bot", replace_live=True)
    assert book.identify(first.secret) is None and book.identify(second.secret).name == "wiki-bot"
    book.revoke("wiki-bot")
    with pytest.raises(KeyNameError, match="no live key named 'wiki-bot'"):
        book.revoke("wiki-bot")
    assert book.issue("wiki-bot").key.live  # a revoked name may be issued again


def test_a_revocation_by_another_process_counts_on_the_next_lookup(tmp_path):
    running = KeyBook(tmp_path)  # the API's view
    issued = running.issue("bob")
    assert running.identify(issued.secret) is not None
    code = ("import sys; from engine.trust.key_book import KeyBook; "
            "print(KeyBook(sys.argv[1]).revoke('bob').revoked_at)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                         check=True, cwd=Path(__file__).parents[2])
    assert out.stdout.strip()
    assert running.identify(issued.secret) is None
    assert running.get("bob").revoked_at == out.stdout.strip()


def test_a_corrupt_book_is_an_error_never_an_empty_book(tmp_path):
    book = KeyBook(tmp_path)
    issued = book.issue("carol")
    damage_key_record(tmp_path, "carol")
    with pytest.raises(KeyBookError, match="damaged"):
        book.identify(issued.secret)
    with pytest.raises(KeyBookError, match="damaged"):
        book.issue("carol", replace_live=True)
    StateDB.forget(tmp_path)
    book.path.write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)  # the file itself damaged
    for path in tmp_path.glob(f"{DB_FILE}-*"):
        path.unlink()
    with pytest.raises(KeyBookError, match=f"{DB_FILE} is damaged"):
        KeyBook(tmp_path).identify(issued.secret)
    assert book.path.read_bytes().startswith(b"SQLite format 3\x00\xff")  # left as it was


def test_adopt_and_revoke_member(tmp_path):
    book = KeyBook(tmp_path)
    old_secret = KEY_PREFIX + "kept-in-the-keyring"
    book.adopt("console", old_secret)
    assert book.adopt("console", old_secret).live  # the same secret again: unchanged
    assert book.identify(old_secret).name == "console"
    tray = book.issue("tray-pc1-abcd", node_id="ab" * 32)
    other = book.issue("tray-pc2-cdef", node_id="cd" * 32)
    assert [k.name for k in book.revoke_member("ab" * 32)] == ["tray-pc1-abcd"]
    assert book.identify(tray.secret) is None and book.identify(other.secret) is not None


def test_key_check_prefers_the_book_and_keeps_a_fixed_key(tmp_path):
    book = KeyBook(tmp_path)
    issued = book.issue("eve", tpm=100)
    check = KeyCheck("fixed-key", book)
    eve_scope = f"key:{digest(issued.secret)[:32]}"
    assert check.identify(issued.secret) == Caller("eve", None, 100, scope=eve_scope)
    assert check.identify("fixed-key") == Caller("default", scope="default", metrics=True)  # the operator's
    monitor = book.issue("grafana", metrics=True)
    assert check.identify(monitor.secret).metrics and not check.identify(issued.secret).metrics
    again = book.issue("eve", replace_live=True)  # the same name issued again: a scope of its own
    assert check.identify(again.secret).scope not in ("", eve_scope, check.identify(monitor.secret).scope)
    assert check.identify("nope") is None
    assert not KeyCheck().required and KeyCheck(book=book).required


# -- the rate limiter (pure) -----------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_slide():
    clock = Clock()
    limiter = RateLimiter(clock)
    caller = Caller("alice", rpm=2)
    assert limiter.admit(caller) is None
    clock.now += 10
    assert limiter.admit(caller) is None
    clock.now += 5
    assert limiter.admit(caller) == pytest.approx(45.0)  # the first leaves the window at +60
    clock.now += 45
    assert limiter.admit(caller) is None
    assert limiter.admit(caller) == pytest.approx(10.0)
    assert limiter.admit(Caller("bob", rpm=2)) is None  # windows are per name
    assert limiter.admit(Caller("nolimit")) is None


def test_tokens_per_minute_count_prompt_and_answer():
    clock = Clock()
    limiter = RateLimiter(clock)
    caller = Caller("bot", tpm=100)
    assert limiter.admit(caller) is None
    limiter.charge(caller, 40)  # prompt
    clock.now += 1
    limiter.charge(caller, 70)  # answer: 110 >= 100
    clock.now += 1
    assert limiter.admit(caller) == pytest.approx(58.0)  # once the 40 leave, 70 < 100
    clock.now += 58
    assert limiter.admit(caller) is None
    limiter.charge(caller, 0)


def test_retry_after_is_whole_seconds_rounded_up():
    assert [retry_after_header(s) for s in (0.001, 1.0, 1.2, 44.5)] == ["1", "1", "2", "45"]


# -- over HTTP with the real openai client ----------------------------------------------------------

def test_no_key_wrong_key_and_revoked_key_are_401(tmp_path):
    book = KeyBook(tmp_path)
    alice = book.issue("alice")
    with serving(ScriptedGenerator(), SETTINGS, keys=book) as url:
        with openai.OpenAI(base_url=url, api_key=alice.secret, max_retries=0, timeout=TIMEOUT) as client:
            answer = client.chat.completions.create(model="fake", messages=CHAT, max_tokens=4)
            assert answer.choices[0].message.content == "okay"
            # with alice's valid key and the header omitted, the client sends no Authorization at all
            # (a 401 where her key would be answered). Recent clients add the key in an auth hook,
            # so the request a response carries does not show the header either way.
            no_key = {"Authorization": openai.Omit()}
            for key, headers in ((alice.secret, no_key), ("sk-deskfleet-wrong", None), (alice.secret + "x", None)):
                with openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=TIMEOUT) as stranger:
                    with pytest.raises(openai.AuthenticationError) as refused:
                        stranger.chat.completions.create(model="fake", messages=CHAT, extra_headers=headers)
                    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
                    assert refused.value.response.headers["www-authenticate"] == "Bearer"
            request = urllib.request.Request(f"{url}/chat/completions", method="POST",  # no header, plainly
                                             data=json.dumps({"model": "fake", "messages": CHAT}).encode(),
                                             headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as bare:
                urllib.request.urlopen(request, timeout=TIMEOUT)
            assert bare.value.code == 401 and bare.value.headers["WWW-Authenticate"] == "Bearer"
            assert json.loads(bare.value.read())["error"]["code"] == "invalid_api_key"
            KeyBook(tmp_path).revoke("alice")  # as `deskfleet keys revoke` would, from another book object
            with pytest.raises(openai.AuthenticationError):
                client.chat.completions.create(model="fake", messages=CHAT, max_tokens=4)
            with pytest.raises(openai.AuthenticationError):
                client.models.list()


def test_a_corrupt_book_refuses_every_key_with_503(tmp_path):
    book = KeyBook(tmp_path)
    alice = book.issue("alice")
    with serving(ScriptedGenerator(), SETTINGS, keys=book) as url:
        damage_key_record(tmp_path, "alice")
        with openai.OpenAI(base_url=url, api_key=alice.secret, max_retries=0, timeout=TIMEOUT) as client:
            with pytest.raises(openai.InternalServerError) as refused:
                client.chat.completions.create(model="fake", messages=CHAT)
            assert refused.value.status_code == 503 and refused.value.code == "key_book_unreadable"


def test_over_the_rate_limit_is_429_with_retry_after(tmp_path):
    book = KeyBook(tmp_path)
    slow = book.issue("slow-app", rpm=2)
    thrifty = book.issue("thrifty", tpm=30)
    with serving(ScriptedGenerator(), SETTINGS, keys=book) as url:
        with openai.OpenAI(base_url=url, api_key=slow.secret, max_retries=0, timeout=TIMEOUT) as client:
            for _ in range(2):
                client.chat.completions.create(model="fake", messages=CHAT, max_tokens=4)
            with pytest.raises(openai.RateLimitError) as limited:
                client.chat.completions.create(model="fake", messages=CHAT, max_tokens=4)
            assert limited.value.code == "rate_limit_exceeded" and "2 requests/min" in limited.value.message
            assert 55 <= int(limited.value.response.headers["retry-after"]) <= 60
            client.models.list()  # only generation requests count
        with openai.OpenAI(base_url=url, api_key=thrifty.secret, max_retries=0, timeout=TIMEOUT) as client:
            first = client.chat.completions.create(model="fake", messages=CHAT, max_tokens=4)
            second = client.chat.completions.create(model="fake", messages=CHAT, max_tokens=4)
            assert first.usage.total_tokens + second.usage.total_tokens >= 30  # 2 x (prompt 24 + answer 4)
            with pytest.raises(openai.RateLimitError) as limited:
                client.chat.completions.create(model="fake", messages=CHAT, max_tokens=4)
            assert "30 tokens/min" in limited.value.message
            assert 1 <= int(limited.value.response.headers["retry-after"]) <= 60


def test_plain_http_is_refused_off_loopback_and_tls_uses_the_fleet_ca(tmp_path):
    from engine.api.guard import api_client_context, check_exposure
    from engine.api.server import async_run_api
    from engine.errors import DeskfleetError
    from engine.trust.fleet_ca import FleetAuthority, Role

    for host in ("0.0.0.0", "192.168.1.10", "::"):
        with pytest.raises(DeskfleetError, match="plain HTTP"):
            check_exposure(host, tls=False)
        with pytest.raises(DeskfleetError, match="plain HTTP"):
            asyncio.run(async_run_api(ScriptedGenerator(), None, SETTINGS, host, 0))
    check_exposure("127.0.0.1", tls=False)
    check_exposure("::1", tls=False)
    check_exposure("localhost", tls=False)

    authority = FleetAuthority.create("test fleet")
    service = authority.issue_credentials("service", role=Role.CONSOLE)
    book = KeyBook(tmp_path)
    alice = book.issue("alice")
    tls = service.server_context(verify_clients=False)
    with serving(ScriptedGenerator(), SETTINGS, keys=book, ssl_context=tls) as url:
        assert url.startswith("https://")
        http = openai.DefaultHttpxClient(verify=api_client_context(authority.ca_pem))
        with openai.OpenAI(base_url=url, api_key=alice.secret, max_retries=0, timeout=TIMEOUT,
                           http_client=http) as client:
            assert client.chat.completions.create(model="fake", messages=CHAT, max_tokens=4).choices
        from console.shared.chat_model import ChatClient, ChatError  # the tray's and the console's chat

        assert asyncio.run(ChatClient(url, alice.secret, ca_pem=authority.ca_pem).async_models()) == ["fake"]
        with pytest.raises(ChatError):
            asyncio.run(ChatClient(url, "sk-deskfleet-wrong", ca_pem=authority.ca_pem).async_models())
    member = authority.issue_credentials("a member posing as the service", role=Role.AGENT)
    posing = member.server_context(verify_clients=False)
    with serving(ScriptedGenerator(), SETTINGS, keys=book, ssl_context=posing) as url:
        with pytest.raises(ChatError, match="another fleet member is posing as it"):  # the key is never sent
            asyncio.run(ChatClient(url, alice.secret, ca_pem=authority.ca_pem).async_models())
    with serving(ScriptedGenerator(), SETTINGS, keys=book, ssl_context=tls) as url:
        other = FleetAuthority.create("another fleet")
        http = openai.DefaultHttpxClient(verify=api_client_context(other.ca_pem))
        with openai.OpenAI(base_url=url, api_key=alice.secret, max_retries=0, timeout=TIMEOUT,
                           http_client=http) as client:
            with pytest.raises(openai.APIConnectionError):
                client.models.list()


# -- the command line ------------------------------------------------------------------------------

def test_keys_command_issues_lists_and_revokes(tmp_path, capsys):
    from engine.cli.main import main
    from engine.control.fleet_services import CA_CERT, CA_KEY

    # a folder without a fleet is refused: a key issued there would work nowhere
    assert main(["keys", "--state-dir", str(tmp_path), "issue", "alice"]) == 1
    assert "holds no fleet" in capsys.readouterr().err and not list(tmp_path.iterdir())
    for name in (CA_CERT, CA_KEY):  # what makes a folder a fleet's (the command reads nothing else of them)
        (tmp_path / name).write_text("")
    # --state-dir after the action, as the README writes it, works as well as before it
    assert main(["keys", "issue", "alice", "--rpm", "5", "--tpm", "900", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    secret = out.out.strip()
    assert secret.startswith(KEY_PREFIX) and "only time its secret is shown" in out.err
    assert KeyBook(tmp_path).identify(secret).name == "alice"
    assert main(["keys", "--state-dir", str(tmp_path), "issue", "alice"]) == 1
    assert "live key named 'alice' exists" in capsys.readouterr().err
    assert main(["keys", "--state-dir", str(tmp_path), "list"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["NAME", "HOLDER", "GROUP", "RPM", "TPM", "DAY", "MONTH", "METRICS",
                                             "ISSUED", "REVOKED"]
    assert table.splitlines()[1].split()[:5] == ["alice", "-", "-", "5", "900"] and secret not in table
    assert main(["keys", "--state-dir", str(tmp_path), "set", "alice", "--holder", "Alice", "--group", "lab",
                 "--day-tokens", "1000"]) == 0
    capsys.readouterr()
    assert (KeyBook(tmp_path).get("alice").holder, KeyBook(tmp_path).get("alice").day_tokens) == ("Alice", 1000)
    assert KeyBook(tmp_path).get("alice").rpm == 5  # what set does not name stays
    assert main(["keys", "--state-dir", str(tmp_path), "group", "lab", "--month-tokens", "50000"]) == 0
    assert "group 'lab': 50000 tokens per month" in capsys.readouterr().err
    assert main(["keys", "--state-dir", str(tmp_path), "revoke", "alice"]) == 0
    capsys.readouterr()
    assert KeyBook(tmp_path).identify(secret) is None
    assert main(["keys", "--state-dir", str(tmp_path), "list", "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["name"] == "alice" and listed["revoked_at"]
    assert main(["keys", "--state-dir", str(tmp_path), "revoke", "bob"]) == 1
    assert "no live key named 'bob'" in capsys.readouterr().err


def test_keys_command_defaults_to_the_consoles_state_dir():
    from console.fleet_api.fleet_settings import default_state_dir as console_default
    from engine.cli.keys import default_state_dir

    assert default_state_dir() == console_default()


# -- keys through enrolment ------------------------------------------------------------------------

def test_a_joining_pc_gets_its_own_chat_key_and_loses_it_when_removed(tmp_path):
    from engine.control.enrollment import async_join
    from engine.control.fleet_services import fleet_host

    async def scenario():
        async with fleet_host(tmp_path / "service") as host:
            joined = await async_join(host.enrollment, host.token(), "Front Desk PC")
            again = await async_join(host.enrollment, host.token(), "Front Desk PC")
            console_before = host.api_key
            host.rotate_api_key()
            return host, joined, again, console_before, host.revoke_member_keys(joined.credentials.node_id)

    host, joined, again, console_before, revoked = asyncio.run(scenario())
    book = KeyBook(tmp_path / "service")
    node = joined.credentials.node_id
    assert joined.api_key.startswith(KEY_PREFIX) and joined.api_key not in book.path.read_text()
    assert book.get(f"tray-Front-Desk-PC-{node[:8]}").node_id == node
    assert revoked == (f"tray-Front-Desk-PC-{node[:8]}",)  # the PC removed: its key only
    assert book.identify(joined.api_key) is None
    assert book.identify(again.api_key).name == f"tray-Front-Desk-PC-{again.credentials.node_id[:8]}"
    assert book.identify(host.api_key).name == "console" and book.identify(console_before) is None
    assert "api_key" not in repr(joined) and joined.api_key not in repr(joined)


def test_an_agent_keeps_its_chat_key_in_its_state(tmp_path):
    from agent.service.service import AgentService
    from agent.service.settings import AgentSettings, load_state
    from engine.control.fleet_services import fleet_host
    from tests.support.agent_helpers import FakeIdle

    async def scenario():
        async with fleet_host(tmp_path / "service") as host:
            settings = AgentSettings(name="desk-1", interface="127.0.0.1", control_port=0, data_port=0)
            agent = AgentService(tmp_path / "agent", settings, idle_source=FakeIdle(1e6), power=lambda: None)
            await agent.async_start()
            try:
                await agent.async_join(host.enrollment, host.token())
                return agent.chat_key, agent.status().node_id
            finally:
                await agent.async_close()

    chat_key, node_id = asyncio.run(scenario())
    assert KeyBook(tmp_path / "service").identify(chat_key).node_id == node_id
    state_file = tmp_path / "agent" / "state.json"
    assert load_state(tmp_path / "agent").chat_key == chat_key and stat.S_IMODE(state_file.stat().st_mode) == 0o600
