"""The OpenAI wire schema, pure: request parsing and limits, the incremental detokenizer with
stop strings, and the shapes of answers and stream chunks."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from engine.api.generate import choice_seed, to_generation_request, to_generation_requests
from engine.api.openai_answer import ChoiceBuilder, CompletionChunks, completion_response, sse_event, token_usage
from engine.api.openai_schema import ApiError, parse_completion
from engine.generation.request import JsonConstraint, TokenEvent
from tests.support.api_helpers import CARD, EOS, SETTINGS, ByteTokenizer


def answered(kind: str, text: str, finish: str, **kw) -> ChoiceBuilder:
    """A choice built from ``text``'s bytes as token events (ByteTokenizer ids), closed with ``finish``."""
    builder = ChoiceBuilder(0, kind, ByteTokenizer().decode, **kw)
    for i, token in enumerate(text.encode()):
        builder.push(TokenEvent(token, i))
    builder.close(finish)
    return builder


# -- request parsing -----------------------------------------------------------------------------

def test_chat_body_maps_to_params_and_generation_request():
    body = {"model": "fake", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 3,
        "stop": "\n\n", "n": 1, "stream": True, "stream_options": {"include_usage": True}, "user": "x"}
    params = parse_completion(body, "chat", "fake")
    assert params.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\nthere"})
    assert (params.max_tokens, params.stop, params.stream, params.include_usage) == (7, ("\n\n",), True, True)
    assert (params.sampling.temperature, params.sampling.top_p, params.sampling.top_k, params.sampling.seed) == (
        0.5, 0.9, 40, 3)
    req = to_generation_request([1, 2, 3], params, SETTINGS, CARD)
    assert (req.prompt_ids, req.max_new_tokens, req.stop_token_ids, req.sampling) == ((1, 2, 3), 7, (EOS,),
                                                                                     params.sampling)


def test_completion_prompt_forms_and_defaults():
    assert parse_completion({"prompt": "hi"}, "text", "fake").prompt == "hi"
    assert parse_completion({"prompt": ["hi"]}, "text", "fake").prompt == "hi"
    assert parse_completion({"prompt": [5, 6]}, "text", "fake").prompt == (5, 6)
    params = parse_completion({"prompt": "hi", "stream_options": {"include_usage": True}}, "text", "fake")
    assert params.sampling.temperature == 1.0 and not params.include_usage  # OpenAI default; not streaming
    # No max_tokens: the server default, clipped to what the context still holds.
    assert to_generation_request(range(1, 11), params, SETTINGS, CARD).max_new_tokens == 20
    assert to_generation_request(range(1, 51), params, replace(SETTINGS, max_prompt_tokens=60), CARD
                                 ).max_new_tokens == 14


@pytest.mark.parametrize("patch, param", [
    ({"temperature": 3}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"top_p": -0.1}, "top_p"),
    ({"n": 9}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"seed": -1}, "seed"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": [""]}, "stop"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": None}]}, "messages"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"stream": "yes"}, "stream"), ({"top_k": -2}, "top_k"),
])
def test_invalid_fields_are_400_naming_the_field(patch, param):
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], **patch}
    with pytest.raises(ApiError) as info:
        parse_completion(body, "chat", "fake")
    assert (info.value.status, info.value.param, info.value.type) == (400, param, "invalid_request_error")


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_a_schema_keeps_the_clients_property_order():
    """The constrained answer writes properties in the schema's order, as OpenAI's does: the schema
    text must not come out with its keys sorted (a model then writes "age" before "name")."""
    schema = {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}},
              "required": ["zeta", "alpha"]}
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
    text = parse_completion(body, "chat", "fake", pending=()).response_format.schema
    assert text.index('"zeta"') < text.index('"alpha"')
    assert list(json.loads(text)["properties"]) == ["zeta", "alpha"]


def test_response_format_logprobs_and_n_are_carried_to_the_generation_requests():
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA,
                                                                              "strict": True}},
            "logprobs": True, "top_logprobs": 5, "n": 3, "seed": 10}
    params = parse_completion(body, "chat", "fake", pending=())
    assert params.response_format == JsonConstraint(json.dumps(SCHEMA, separators=(",", ":")),
                                                    "place", True)
    assert (params.logprobs, params.n, params.constraint) == (5, 3, params.response_format)
    requests = to_generation_requests([1, 2], params, SETTINGS, CARD)
    assert [r.sampling.seed for r in requests] == [10, 11, 12]
    assert {(r.logprobs, r.constraint, r.prompt_ids) for r in requests} == {(5, params.response_format, (1, 2))}
    assert choice_seed(None, 2) is None and choice_seed((1 << 63) - 1, 1) == 0
    assert parse_completion({**CHAT, "response_format": {"type": "json_object"}}, "chat", pending=()
                            ).constraint == JsonConstraint()
    assert parse_completion({**CHAT, "response_format": {"type": "text"}}, "chat").response_format is None
    assert parse_completion({**CHAT, "logprobs": False}, "chat").logprobs is None
    assert parse_completion({**CHAT, "logprobs": True}, "chat", pending=()).logprobs == 0
    assert parse_completion({"prompt": "x", "logprobs": 0}, "text", pending=()).logprobs == 0
    assert parse_completion({"prompt": "x", "n": 8}, "text").n == 8


@pytest.mark.parametrize("kind, patch, param", [
    ("chat", {"response_format": {"type": "json"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": 3}, "logprobs"),  # chat takes a boolean
    ("text", {"logprobs": True}, "logprobs"), ("text", {"logprobs": 21}, "logprobs"),
    ("text", {"top_logprobs": 1}, "top_logprobs"), ("text", {"tools": []}, "tools"),
    ("chat", {"n": 0}, "n"), ("chat", {"best_of": 2}, "best_of"), ("chat", {"functions": [{}]}, "functions"),
])
def test_bad_new_fields_are_400_naming_the_field(kind, patch, param):
    body = {**(CHAT if kind == "chat" else {"prompt": "x"}), **patch}
    with pytest.raises(ApiError) as info:
        parse_completion(body, kind, pending=())
    assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize("patch, param", [
    ({"logprobs": True}, "logprobs"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice"),
])
def test_features_a_generator_does_not_honour_are_400_by_default(patch, param):
    with pytest.raises(ApiError) as info:
        parse_completion({**CHAT, **patch}, "chat")
    assert (info.value.status, info.value.param) == (400, param) and "does not" in info.value.message
    assert parse_completion({**CHAT, **patch}, "chat", pending=()).features() == {
        "logprobs": {"logprobs"}, "response_format": {"response_format"}, "tool_choice": {"forced_tool_call"}}[param]


def test_choice_logprobs_and_tool_call_shapes():
    text = answered("text", "aé", "stop", logprobs=1)
    assert text.choice()["logprobs"] == {"tokens": ["a", "\ufffd", "\ufffd"], "token_logprobs": [None] * 3,
                                         "top_logprobs": [{}, {}, {}], "text_offset": [0, 1, 1]}
    chat = answered("chat", "a", "stop", logprobs=0).choice()
    assert chat["logprobs"] == {"content": [{"token": "a", "logprob": None, "bytes": [97], "top_logprobs": []}],
                                "refusal": None}
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    called = answered("chat", call, "stop", tools={"f"}).choice()
    assert called["finish_reason"] == "tool_calls" and called["message"]["content"] is None
    (tool_call,) = called["message"]["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert answered("chat", call, "length", tools={"f"}).choice()["finish_reason"] == "length"
    assert answered("chat", call, "stop").choice()["message"] == {"role": "assistant", "content": call}


def test_top_p_zero_is_refused_by_sampling_params():
    with pytest.raises(ApiError) as info:
        parse_completion({"prompt": "x", "top_p": 0}, "text", "fake")
    assert info.value.status == 400 and "top_p" in info.value.message


def test_unknown_model_is_404():
    with pytest.raises(ApiError) as info:
        parse_completion({"model": "gpt-4", "prompt": "x"}, "text", "fake")
    assert info.value.status == 404 and "'fake'" in info.value.message


@pytest.mark.parametrize("n_prompt, max_tokens, code", [
    (41, None, "context_length_exceeded"),  # over max_prompt_tokens
    (30, 51, "invalid_value"),  # over max_tokens_limit
    (30, 40, "context_length_exceeded"),  # prompt + max_tokens over the context of 64
])
def test_limits_are_400(n_prompt, max_tokens, code):
    params = parse_completion({"prompt": "x", "max_tokens": max_tokens}, "text", "fake")
    with pytest.raises(ApiError) as info:
        to_generation_request(range(1, n_prompt + 1), params, SETTINGS, CARD)
    assert (info.value.status, info.value.code) == (400, code)


# -- response shapes -----------------------------------------------------------------------------

def test_answer_and_chunk_shapes():
    usage = token_usage(5, 2)
    assert usage == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    chat_choice = answered("chat", "hi", "stop")
    chat = completion_response("chat", "fake", [chat_choice.choice()], usage)
    assert chat["id"].startswith("chatcmpl-") and chat["object"] == "chat.completion" and chat["usage"] == usage
    assert chat["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                "finish_reason": "stop", "logprobs": None}]
    text_choice = answered("text", "hi", "length").choice()
    assert completion_response("text", "fake", [text_choice], usage)["choices"][0]["text"] == "hi"

    chunks = CompletionChunks("chat", "fake", include_usage=True)
    builder = ChoiceBuilder(0, "chat", ByteTokenizer().decode)
    deltas = [*(d for t in "hé".encode() for d in builder.push(TokenEvent(t, 0))), *builder.close("stop")]
    sent = [*chunks.opening(), *map(chunks.chunk, deltas), chunks.usage(usage)]
    assert len({(c["id"], c["object"], c["created"], c["model"]) for c in sent}) == 1
    assert sent[0]["object"] == "chat.completion.chunk" and sent[0]["usage"] is None
    assert [c["choices"][0]["delta"] for c in sent[:-1]] == [{"role": "assistant", "content": ""},
                                                              {"content": "h"}, {"content": "é"}, {}]
    assert sent[-2]["choices"][0]["finish_reason"] == "stop"
    assert sent[-1]["choices"] == [] and sent[-1]["usage"] == usage
    text = CompletionChunks("text", "fake")
    assert text.opening() == [] and "usage" not in text.chunk({"index": 0, "text": "a"})
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode() and sse_event("[DONE]") == b"data: [DONE]\n\n"


def test_the_schema_imports_no_aiohttp():
    code = "import sys, engine.api.openai_schema; print(sorted(m for m in sys.modules if m.startswith('aiohttp')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"
