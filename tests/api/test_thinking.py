"""Thinking models through the API (issue 28): the reasoning in ``reasoning_content`` (message and
stream deltas), the answer in ``content``, ``reasoning_effort`` as the template's switch, read by
the real ``openai`` client from a canned thinking answer."""

from __future__ import annotations

import openai
import pytest

from tests.support.api_helpers import ThinkingByteTokenizer
from tests.support.canned_api import CannedGenerator, served

THOUGHT = "<think>\nThe user asks for France's capital. It is Paris.\n</think>\n\nThe capital of France is Paris."
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def test_openai_client_reads_reasoning_apart_from_the_answer_whole_and_streamed():
    generator = CannedGenerator(THOUGHT)
    with served(generator, tokenizer=ThinkingByteTokenizer()) as url, \
            openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=30) as client:
        whole = client.chat.completions.create(model="fake", messages=ASK)
        chunks = list(client.chat.completions.create(model="fake", messages=ASK, stream=True))
    message = whole.choices[0].message
    assert message.content == "The capital of France is Paris."
    assert message.reasoning_content == "The user asks for France's capital. It is Paris."
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (message.reasoning_content, message.content)
    # the reasoning streams before the answer, never in the same delta
    kinds = [("r" if getattr(d, "reasoning_content", None) else "c") for d in deltas
             if getattr(d, "reasoning_content", None) or d.content]
    assert kinds == sorted(kinds, reverse=True) and "r" in kinds and "c" in kinds


@pytest.mark.parametrize("effort, block", [("none", True), ("minimal", True), ("high", False), (None, False)])
def test_reasoning_effort_switches_thinking_through_the_template(effort, block):
    generator = CannedGenerator("Paris.")
    extra = {"reasoning_effort": effort} if effort else {}
    with served(generator, tokenizer=ThinkingByteTokenizer()) as url, \
            openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=30) as client:
        answer = client.chat.completions.create(model="fake", messages=ASK, **extra)
    prompt = bytes(generator.requests[0].prompt_ids).decode()
    assert prompt.endswith("<think>\n\n</think>\n\n") is block
    assert answer.choices[0].message.content == "Paris." and answer.choices[0].message.reasoning_content is None


def test_a_block_the_prompt_opened_is_reasoning_and_earlier_reasoning_goes_back_to_the_template():
    generator = CannedGenerator("Paris is the capital.\n</think>\n\nParis.")
    history = [*ASK, {"role": "assistant", "content": "Paris.", "reasoning_content": "I know this."},
               {"role": "user", "content": "Sure?"}]
    with served(generator, tokenizer=ThinkingByteTokenizer(opens=True)) as url, \
            openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=30) as client:
        answer = client.chat.completions.create(model="fake", messages=history)
    assert answer.choices[0].message.reasoning_content == "Paris is the capital."
    assert answer.choices[0].message.content == "Paris."
    assert "<assistant>I know this.|Paris." in bytes(generator.requests[0].prompt_ids).decode()


def test_a_bad_reasoning_effort_is_a_400_naming_it():
    with served(CannedGenerator("x"), tokenizer=ThinkingByteTokenizer()) as url, \
            openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=30) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="fake", messages=ASK, reasoning_effort="extreme")
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="fake", prompt="hi", extra_body={"reasoning_effort": "low"})
    assert caught.value.body["param"] == "reasoning_effort" and "extreme" in caught.value.body["message"]


def test_a_model_that_does_not_think_has_no_reasoning_field():
    with served(CannedGenerator(THOUGHT)) as url, \
            openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=30) as client:
        answer = client.chat.completions.create(model="fake", messages=ASK, reasoning_effort="none")
    assert answer.choices[0].message.content == THOUGHT
    assert "reasoning_content" not in answer.choices[0].message.model_dump()
