"""Structured output on the real default model (SmolLM2-135M-Instruct, 2 INT4 stages; slow lane):
``client.chat.completions.parse`` with a Pydantic model through ``deskfleet serve --workers`` (the
paged runtime over a worker process per stage, the masks on the wire) gives a valid object that
finishes by itself, greedy and seeded sampled, and a seeded answer repeats. One served process
for the module.

Unlike the tiny random model, this one writes sensible values, so the schemas here have free
strings and numbers, bounded: a 135M model may run a string on past the budget, and a float's
digits have no end in the grammar (greedy wrote a population of "11.5888..." until the limit).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.api_helpers import serve_process

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=100)  # a float: greedy ran "11.5888..." to the token limit


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=130)
    job: str = Field(max_length=40)
    likes_coffee: bool


ASKS = {City: "Tell me about the capital of France as JSON: its name, its country and its population in millions.",
        Person: "Invent one person who works in an office, as JSON: name, age, job and whether they like coffee."}


@pytest.fixture(scope="module")
def client(default_export_int4):
    with serve_process("--shards", str(default_export_int4), "--workers", "--model-name", "smollm2",
                       ready_timeout=300) as url, \
            openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def parse(client, model: type[BaseModel], **sampling):
    done = client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": ASKS[model]}],
                                         response_format=model, max_tokens=160, **sampling)
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, model)
    jsonschema.validate(json.loads(choice.message.content), model.model_json_schema())
    return choice.message


@pytest.mark.parametrize("model", [City, Person])
def test_parse_greedy_gives_a_valid_object(client, model):
    message = parse(client, model, temperature=0)
    assert parse(client, model, temperature=0).content == message.content  # greedy repeats
    if model is City:
        assert message.parsed.name.strip()  # a name, not an empty string


@pytest.mark.parametrize("model", [City, Person])
def test_parse_seeded_sampling_gives_a_valid_object_that_repeats(client, model):
    first = parse(client, model, temperature=0.9, seed=7)
    assert parse(client, model, temperature=0.9, seed=7).content == first.content
    parse(client, model, temperature=1.2, seed=8)
