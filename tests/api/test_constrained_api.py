"""Structured output, forced tool calls and log-probabilities end to end (issue 17): the real
``openai`` client against ``deskfleet serve`` in a subprocess, over the tiny 2-stage export on the
paged runtime with its stages in worker processes (``--workers``: the masks and the top-k travel
the wire protocol), the grammar enforced by llguidance. LangChain's ``with_structured_output`` and
``bind_tools`` go the same way.

The tiny model's weights are random, so what it says is the grammar's doing alone: the schemas
here use enums and booleans, whose answers are always complete within the token budget.
"""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.support.api_helpers import serve_process

ASK = [{"role": "user", "content": "Describe a shape as JSON."}]
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
           "additionalProperties": False}
# One short tool: the generic tool block costs the tiny tokenizer ~400 of the model's 512 positions.
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}}]


class Shape(BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]
    size: Literal[1, 2, 3]


@pytest.fixture(scope="module")
def client(tiny_export):
    export = tiny_export("llama", 2)
    with serve_process("--shards", str(export), "--workers", "--exact", "--model-name", "tiny") as url, \
            openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_parse_with_a_pydantic_model_gives_that_model_greedy_and_sampled(client):
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 4}, {"temperature": 1.3, "seed": 5}):
        done = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Shape, max_tokens=200,
                                             **extra)
        choice = done.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Shape)
        assert Shape.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_and_a_streamed_schema_are_valid_json(client):
    schema = {**Shape.model_json_schema(), "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "shape", "schema": schema, "strict": True}}
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, stream=True,
                                                 max_tokens=200, temperature=0.9, seed=1))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    jsonschema.validate(json.loads(text), schema)
    free = client.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"},
                                          max_tokens=300, temperature=0)
    if free.choices[0].finish_reason == "stop":  # a free string may outrun the budget
        assert isinstance(json.loads(free.choices[0].message.content), dict)


def check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    return arguments


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_a_forced_tool_call_round_trip_streamed_and_not(client, choice):
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice=choice,
               max_tokens=80, temperature=0.8, seed=2)
    whole = client.chat.completions.create(**ask)
    assert whole.choices[0].finish_reason == "tool_calls"
    (call,) = whole.choices[0].message.tool_calls
    arguments = check_call(call)
    with client.chat.completions.stream(**ask) as stream:  # the client assembles the streamed deltas
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls
    assert (streamed.function.name, json.loads(streamed.function.arguments)) == ("weather", arguments)
    assert final.choices[0].finish_reason == "tool_calls"
    # the call and the tool's result go back (tools not shown again: the tiny context is short)
    history = [*ask["messages"], whole.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sun"})}]
    after = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=8)
    assert after.choices[0].finish_reason in ("stop", "length")


def test_logprobs_in_chat_and_legacy_completions(client):
    chat = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, logprobs=True, top_logprobs=3,
                                          temperature=0)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 6  # (random bytes: the tokens need not join into valid UTF-8)
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)  # greedy: the chosen is the top-1
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    shaped = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, logprobs=True, top_logprobs=3,
                                            temperature=0, response_format={"type": "json_object"})
    first = shaped.choices[0].logprobs.content[0]  # after the mask '{' is the only token allowed first
    assert (first.token, first.logprob, [t.token for t in first.top_logprobs]) == ("{", 0.0, ["{"])
    legacy = client.completions.create(model="tiny", prompt="Once upon", max_tokens=5, logprobs=2, temperature=0)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)


def test_langchain_structured_output_and_a_forced_bound_tool(client):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=str(client.base_url), api_key="unused", model="tiny", max_retries=0, timeout=120,
                      temperature=0.7, seed=3, max_tokens=90)
    shape = chat.with_structured_output(Shape, method="json_schema", strict=True).invoke("Describe a shape.")
    assert isinstance(shape, Shape)
    message = chat.bind_tools(TOOLS, tool_choice="weather").invoke("Weather?")
    (call,) = message.tool_calls
    assert call["name"] == "weather"
    jsonschema.validate(call["args"], WEATHER)


def test_a_schema_that_cannot_be_compiled_is_a_400_naming_it(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "strict": True,
                                                   "schema": {"type": "object", "properties": {"x": {"type": "nope"}}}}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, stream=stream)
        assert "response_format" in info.value.body["message"]
