"""Hostile inputs the second security review found answered late, with a traceback, or too
generously (M6, L1, L2, L3), each played live against the keyed OpenAI API over the tiny 2-stage
export on loopback (tests/security/served_api.py) where it crosses the network, and against the
pure parser or policy where the input is the model's own output or an admin's option."""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import pytest

from console.fleet.tokens_cli import parse_ttl
from engine.api.openai_answer import ChoiceBuilder
from engine.api.openai_schema import MAX_TOKEN_ID
from engine.errors import DeskfleetError, TokenPolicyError
from engine.generation.request import TokenEvent
from engine.generation.tool_calls import parse_tool_calls
from engine.trust.join_token import MAX_AUTO_APPROVE_TTL_S, TokenBook
from tests.security.served_api import KEY, SETTINGS, served
from tests.support.api_helpers import ByteTokenizer
from tests.support.asyncutil import run

LIMIT_CHARS = 8 * SETTINGS.max_prompt_tokens  # CHARS_PER_TOKEN × the served API's token limit
HI = [{"role": "user", "content": "hi"}]


def _tool(name: str, description: str = "") -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": {}}}}


def _call(arguments: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


async def _post(session: aiohttp.ClientSession, url: str, body: dict | str) -> tuple[int, dict]:
    data = body if isinstance(body, str) else json.dumps(body)
    async with session.post(url, data=data, headers={"Authorization": f"Bearer {KEY}",
                                                     "Content-Type": "application/json"}) as reply:
        return reply.status, await reply.json()


async def _raw_status(port: int, authorization: bytes) -> bytes:
    """The status line of a GET /v1/models sent with raw header bytes (a client library would not)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " + authorization +
                     b"\r\nConnection: close\r\n\r\n")
        return await asyncio.wait_for(reader.readline(), 30)
    finally:
        writer.close()


def test_tools_calls_and_deep_or_huge_inputs_are_refused_before_tokenising_with_a_4xx(tiny_export, caplog):
    long = "tell the weather " * (LIMIT_CHARS // 17 + 10)  # over the limit in characters, alone in its field
    deep = "[" * 3000 + "]" * 3000

    async def scenario():
        async with served(tiny_export) as (_, api):
            url = f"http://127.0.0.1:{api.port}/v1/chat/completions"
            async with aiohttp.ClientSession() as session:
                answers = {
                    "tools": await _post(session, url, {"messages": HI, "tools": [_tool("weather", long)]}),
                    "arguments": await _post(session, url, {"messages": [*HI, _call(long)]}),
                    "deep arguments": await _post(session, url, {"messages": [*HI, _call(deep)]}),
                    "reasoning": await _post(session, url, {"messages": [
                        *HI, {"role": "assistant", "content": "x", "reasoning_content": long}, *HI]}),
                    "id 2^63": await _post(session, url.replace("chat/", ""), {"prompt": [1, 1 << 63]}),
                    "id past the vocabulary": await _post(session, url.replace("chat/", ""), {"prompt": [1, 10**9]}),
                    "ok": await _post(session, url, {"messages": HI, "max_tokens": 2}),  # still serving
                }
            answers["non-UTF-8 key"] = await _raw_status(api.port, b"Bearer sk-\xff\xfe")
            return answers

    answers = run(scenario(), 300)
    for what in ("tools", "arguments", "reasoning"):  # counted in characters: refused before any tokenising
        status, body = answers[what]
        message = body["error"]["message"]
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", (what, body)
        assert "characters" in message and str(SETTINGS.max_prompt_tokens) in message, (what, message)
    status, body = answers["deep arguments"]
    assert status == 400 and "nests too deeply" in body["error"]["message"]
    for what in ("id 2^63", "id past the vocabulary"):
        status, body = answers[what]
        assert status == 400 and body["error"]["param"] == "prompt", (what, body)
    assert str(MAX_TOKEN_ID) in answers["id 2^63"][1]["error"]["message"]
    assert "vocabulary" in answers["id past the vocabulary"][1]["error"]["message"]
    assert answers["non-UTF-8 key"].startswith(b"HTTP/1.1 401 ")
    assert answers["ok"][0] == 200, answers["ok"]
    assert not [r for r in caplog.records if r.exc_info], "a hostile input logged a traceback"


def _answered(text: str, tools: set[str]) -> dict:
    builder = ChoiceBuilder(0, "chat", ByteTokenizer().decode, tools=tools)
    for i, token in enumerate(text.encode()):
        builder.push(TokenEvent(token, i))
    builder.close("stop")
    return builder.choice()


def test_a_call_of_an_undeclared_function_is_text_not_a_call():
    injected = '<tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call>'
    choice = _answered(injected, {"get_weather"})
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == injected  # nothing dropped silently: the client sees the text
    declared = _answered(injected.replace("rm_rf", "get_weather"), {"get_weather"})
    assert declared["finish_reason"] == "tool_calls"
    assert declared["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_model_output_nested_past_the_recursion_limit_is_no_call_and_no_crash():
    for body in ("[" * 1200 + "]" * 1200,
                 '{"name": "f", "arguments": ' + "[" * 1200 + "]" * 1200 + "}",
                 '{"name": "f", "arguments": "' + "[" * 1200 + "]" * 1200 + '"}'):
        text = f"<tool_call>{body}</tool_call>"
        assert parse_tool_calls(text) == (text, ())
        assert parse_tool_calls(text, {"f"}) == (text, ())


@pytest.mark.parametrize("ttl", [math.inf, math.nan, 1e300, -math.inf])
def test_a_join_token_lives_a_finite_bounded_time(tmp_path, ttl):
    book = TokenBook(tmp_path / "tokens.json", "ab" * 32)
    with pytest.raises(TokenPolicyError):
        book.issue_token(ttl_s=ttl)
    with pytest.raises(TokenPolicyError):
        book.issue_token(ttl_s=ttl, auto_approve=True)


def test_an_auto_approving_token_lasts_thirty_days_at_most(tmp_path):
    book = TokenBook(tmp_path / "tokens.json", "ab" * 32)
    assert book.issue_token(ttl_s=MAX_AUTO_APPROVE_TTL_S, auto_approve=True).info.auto_approve
    with pytest.raises(TokenPolicyError, match="30 days"):
        book.issue_token(ttl_s=MAX_AUTO_APPROVE_TTL_S + 1, auto_approve=True)
    assert book.issue_token(ttl_s=MAX_AUTO_APPROVE_TTL_S + 1).info  # a plain token may last longer


@pytest.mark.parametrize("text", ["inf", "Infinity", "nan", "-inf", "1e400"])
def test_the_cli_refuses_an_endless_ttl(text):
    with pytest.raises(DeskfleetError, match="finite"):
        parse_ttl(text)
