"""Structured output and forced tool calls on the embedded default model (SmolLM2-135M-Instruct,
2 INT4 stages on the paged runtime in this process) through the real ``openai`` client and
LangChain (issue 17, slow lane). Its 49,152-token vocabulary is the one the masks are sized for;
whatever it chooses, a stopped answer must be valid for its schema, greedy and sampled."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.fuzz_helpers import loop_thread

pytestmark = pytest.mark.slow

KEY = "sk-structured"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": WEATHER}}]


class Person(BaseModel):
    name: str = Field(max_length=24)  # bounded: a small model may otherwise repeat itself in a string
    age: int = Field(ge=0, le=120)
    likes_tea: bool


@pytest.fixture(scope="module")
def client(default_export_int4):
    from engine.api.server import ApiSettings, async_run_api
    from engine.generation.tokenizer import ChatTokenizer
    from engine.paged.coordinator import BatchCoordinator

    export = default_export_int4
    settings = ApiSettings(api_key=KEY, model_name="smol", max_tokens_limit=256)
    with loop_thread() as loop:
        coordinator = BatchCoordinator.local(export, num_threads=2)
        loop.run(coordinator.__aenter__())
        try:
            api = loop.run(async_run_api(coordinator, ChatTokenizer(export / "tokenizer"), settings))
            try:
                with openai.OpenAI(base_url=api.url, api_key=KEY, max_retries=0, timeout=300) as c:
                    yield c
            finally:
                loop.run(api.async_stop())
        finally:
            loop.run(coordinator.__aexit__(None, None, None))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 11}])
def test_parse_gives_a_valid_model_greedy_and_sampled(client, sampling):
    done = client.chat.completions.parse(
        model="smol", response_format=Person, max_tokens=120, **sampling,
        messages=[{"role": "user", "content": "Invent a person: their name, age, and whether they like tea."}])
    choice = done.choices[0]  # parse() raises on a length finish: every field here is bounded
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)


def test_a_named_tool_call_and_langchain_structured_output(client):
    done = client.chat.completions.create(
        model="smol", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}], max_tokens=80, temperature=0)
    assert done.choices[0].finish_reason == "tool_calls"
    (call,) = done.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=str(client.base_url), api_key=KEY, model="smol", max_retries=0, timeout=300,
                      temperature=0, max_tokens=120)
    person = chat.with_structured_output(Person, method="json_schema", strict=True).invoke(
        "Invent a person who likes tea.")
    assert isinstance(person, Person)
