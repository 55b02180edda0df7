"""Which request features the API serves follows what its generators say they honour (their
``features``): a feature every ring honours is served, one that some ring does not is a 400
naming its field and the runtimes (issue 17). Canned generators over the real server and client."""

from __future__ import annotations

import openai
import pytest

from engine.generation.router import Router
from tests.support.canned_api import CannedGenerator, served

ASK = [{"role": "user", "content": "hi"}]
JSON = {"type": "json_object"}


class Honouring(CannedGenerator):
    def __init__(self, answer: str, features: frozenset[str]):
        super().__init__(answer)
        self.features = features


def ask(url: str, **extra):
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30) as client:
        return client.chat.completions.create(model="fake", messages=ASK, max_tokens=20, **extra)


def refused(url: str, **extra) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        ask(url, **extra)
    return info.value.body


def test_a_generator_without_features_keeps_every_pending_feature_refused():
    with served(CannedGenerator("{}")) as url:
        body = refused(url, response_format=JSON)
        assert body["param"] == "response_format" and "tokenizer.json" in body["message"]
        assert refused(url, logprobs=True)["param"] == "logprobs"
        assert ask(url).choices[0].message.content == "{}"


def test_what_a_generator_honours_is_served_and_only_that():
    generator = Honouring('{"a": 1}', frozenset({"logprobs"}))
    with served(generator) as url:
        answer = ask(url, logprobs=True, top_logprobs=2)
        assert answer.choices[0].logprobs.content[0].logprob < 0
        assert refused(url, response_format=JSON)["param"] == "response_format"
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        assert refused(url, tools=tools, tool_choice="required")["param"] == "tool_choice"
    everything = Honouring('{"a": 1}', frozenset({"logprobs", "response_format", "forced_tool_call"}))
    with served(everything) as url:
        assert ask(url, response_format=JSON).choices[0].message.content == '{"a": 1}'
        assert generator.requests[0].logprobs == 2 and everything.requests[0].constraint is not None


def test_a_feature_is_served_only_when_every_ring_honours_it():
    router = Router()
    router.add_ring("paged", Honouring("{}", frozenset({"logprobs", "response_format"})), model_name="fake")
    router.add_ring("plain", CannedGenerator("{}"), model_name="fake")  # a ring that honours no feature
    with served(router) as url:
        assert refused(url, response_format=JSON)["param"] == "response_format"
    alone = Router()
    alone.add_ring("paged", Honouring("{}", frozenset({"logprobs", "response_format"})), model_name="fake")
    with served(alone) as url:
        assert ask(url, response_format=JSON).choices[0].finish_reason == "stop"
