"""Structured output, forced tool calls and log-probabilities on the stateful runtime (issue 17):
the real ``openai`` client against the API over the tiny 2-stage export's stateful coordinator
(exact f32), whose steps ask for logits and whose stream policy masks and ranks them
(engine.coordinator.scheduler). The tiny model's weights are random, so what it says is the
grammar's doing: the schemas use enums and booleans, complete within the token budget.

Log-probabilities are checked against an independent log-softmax (float64 numpy, here) of the
logits the same export gives for the same tokens in one forward pass, before any temperature.
"""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import numpy as np
import openai
import pytest
from pydantic import BaseModel

from engine.api.server import ApiSettings
from engine.generation.in_process import greedy_generate
from engine.shards.kv_layout import KVLayout
from engine.shards.stage import LocalChain, StepInputs
from tests.support.fuzz_helpers import served_stateful

ASK = [{"role": "user", "content": "Describe a shape as JSON."}]
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}}]
PROMPT = [1, 17, 42, 99, 7, 300, 12, 5]


class Shape(BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]
    size: Literal[1, 2, 3]


@pytest.fixture(scope="module")
def export(tiny_export):
    return tiny_export("llama", 2)


@pytest.fixture(scope="module")
def client(export):
    settings = ApiSettings(max_prompt_tokens=480, default_max_tokens=32, max_tokens_limit=256)
    with served_stateful(export, settings) as (_, coordinator, api, _), \
            openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120) as c:
        assert {"logprobs", "response_format", "forced_tool_call"} <= coordinator.features
        yield c, coordinator.model.name


def test_parse_with_a_pydantic_model_greedy_and_sampled_streamed_and_not(client):
    c, model = client
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 4}, {"temperature": 1.4, "seed": 5}):
        done = c.chat.completions.parse(model=model, messages=ASK, response_format=Shape, max_tokens=200, **extra)
        choice = done.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Shape)
    schema = {**Shape.model_json_schema(), "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "shape", "schema": schema, "strict": True}}
    chunks = list(c.chat.completions.create(model=model, messages=ASK, response_format=fmt, stream=True,
                                            max_tokens=200, temperature=0.9, seed=1))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_a_forced_tool_call_round_trip_streamed_and_not(client, choice):
    c, model = client
    ask = dict(model=model, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice=choice,
               max_tokens=80, temperature=0.8, seed=2)
    whole = c.chat.completions.create(**ask)
    assert whole.choices[0].finish_reason == "tool_calls"
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    with c.chat.completions.stream(**ask) as stream:
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls
    assert (streamed.function.name, json.loads(streamed.function.arguments)) == ("weather", arguments)
    history = [*ask["messages"], whole.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sun"})}]
    after = c.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=6)
    assert after.choices[0].finish_reason in ("stop", "length")


def reference_logprobs(export, prompt, n) -> tuple[list[int], np.ndarray]:
    """The greedy tokens of ``prompt`` and the log-softmax [n, V] (float64) of the logits that
    chose each, from one forward pass of prompt + tokens over a fresh chain of the same export."""
    chain = LocalChain.load(export, exact=True)
    tokens = list(greedy_generate(chain, prompt, n, ignore_eos=True).tokens)
    fed = np.asarray([prompt + tokens[:-1]], dtype=np.int64)
    layout = KVLayout(fed.shape[1])
    mask, positions = layout.plan(fed.shape[1])
    logits = chain.forward(chain.new_streams(), StepInputs(fed, mask, positions, 0))[0].astype(np.float64)
    rows = logits[len(prompt) - 1:]  # [n, V]: the row before each generated token
    top = rows.max(axis=1, keepdims=True)
    return tokens, rows - top - np.log(np.exp(rows - top).sum(axis=1, keepdims=True))


def test_logprobs_equal_an_independent_log_softmax_of_the_same_logits(client, export):
    c, model = client
    n, k = 6, 4
    tokens, want = reference_logprobs(export, PROMPT, n)
    got = c.completions.create(model=model, prompt=PROMPT, max_tokens=n, logprobs=k, temperature=0).choices[0].logprobs
    assert len(got.token_logprobs) == n
    for i, token in enumerate(tokens):
        assert got.token_logprobs[i] == pytest.approx(want[i, token], abs=1e-4)
        best = np.sort(want[i])[::-1][:k]
        assert got.token_logprobs[i] == pytest.approx(best[0], abs=1e-4)  # greedy: the chosen is the top-1
        # a dict by token text: random-byte tokens that decode alike share one key (the later one wins)
        values = got.top_logprobs[i].values()
        assert values and all(np.isclose(best, v, atol=1e-4).any() for v in values)
    # sampled at a temperature: still the raw (temperature 1) log-softmax of the chosen token's row
    hot = c.chat.completions.create(model=model, messages=ASK, max_tokens=5, logprobs=True, top_logprobs=2,
                                    temperature=1.7, seed=11).choices[0].logprobs.content
    assert len(hot) == 5 and all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in hot)
    assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in hot)
    # after the grammar's mask '{' is the only token allowed first: log-probability 0
    shaped = c.chat.completions.create(model=model, messages=ASK, max_tokens=4, logprobs=True, top_logprobs=3,
                                       temperature=0, response_format={"type": "json_object"})
    first = shaped.choices[0].logprobs.content[0]
    assert (first.token, first.logprob, [t.token for t in first.top_logprobs]) == ("{", 0.0, ["{"])


def test_a_schema_that_cannot_be_compiled_is_a_400_naming_it(client):
    c, model = client
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "strict": True,
                                                   "schema": {"type": "object", "properties": {"x": {"type": "nope"}}}}}
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=model, messages=ASK, response_format=fmt)
    assert "response_format" in info.value.body["message"]
