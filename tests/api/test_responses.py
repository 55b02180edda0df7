"""The Responses API (issue 35): ``POST /v1/responses`` whole and streamed, read by the real
``openai`` client's ``responses.create`` / ``responses.stream``; a function-calling round trip
(``function_call`` → ``function_call_output``); ``previous_response_id``, ``GET`` and ``DELETE``
within one key; refusals by name. Text on the real paged coordinator over the tiny export must be
the same greedy text the chat route gives; tool calls are shaped from a canned generator's text
(a tiny random model's free choice of a call is luck), as in test_tools.py."""

from __future__ import annotations

import json

import openai
import pytest

from engine.api.api_error import ApiError
from engine.api.response_store import ResponseStore
from engine.api.responses_schema import parse_response_request
from engine.api.server import ApiSettings
from tests.support.canned_api import CannedGenerator, served
from tests.support.fuzz_helpers import served_paged

KEY = "sk-responses"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


# -- parse: a Responses body is the chat request it means --------------------------------------------

def test_input_items_become_the_chat_conversation():
    params = parse_response_request({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                  {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                  {"role": "developer", "content": "Answer in French."}]}, "m", pending=frozenset())
    chat = params.chat
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "tool", "system"]
    assert chat.messages[2]["tool_calls"][0].name == "get_weather" and chat.messages[3]["tool_call_id"] == "call_1"
    assert chat.max_tokens == 9 and chat.tools[0].name == "get_weather" and chat.tool_choice.name == "get_weather"
    assert params.conversation[0] == {"role": "user", "content": "Weather?"}  # instructions are not chained


@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "function tools only"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "text only"),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format", "json_schema"),
    ({"input": [{"type": "computer_call"}]}, "input", "computer_call"),
    ({"input": "x", "metadata": {"k": "v" * 600}}, "metadata", "512"),
])
def test_what_is_not_served_is_refused_by_name(body, param, words):
    with pytest.raises(ApiError) as caught:
        parse_response_request(body, None)
    assert caught.value.status == 400 and caught.value.param == param and words in caught.value.message


def test_the_store_is_bounded_per_key_and_in_all_and_a_key_sees_only_its_own():
    now = [0.0]
    store = ResponseStore(max_entries=4, per_owner=3, ttl_s=10, clock=lambda: now[0])
    for i in range(5):
        store.put("alice", {"id": f"a{i}"}, ())
    assert len(store) == 3 and store.get("alice", "a0") is None and store.get("alice", "a4") is not None
    store.put("bob", {"id": "b0"}, ())
    store.put("bob", {"id": "b1"}, ())
    assert len(store) == 4 and store.get("alice", "a2") is None  # the oldest of all went
    assert store.get("bob", "a4") is None and not store.delete("bob", "a4")  # not another key's
    now[0] = 11.0
    assert store.get("bob", "b1") is None and len(store) == 0 and store.bytes == 0


# -- live: the real openai client ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_api(tiny_export):
    settings = ApiSettings(api_key=KEY, max_prompt_tokens=200, default_max_tokens=12, max_tokens_limit=64)
    with served_paged(tiny_export("llama", 2), settings) as (_, coordinator, api, _):
        yield api.url, coordinator.model.name


def test_text_whole_and_streamed_is_the_chat_routes_greedy_text(tiny_api):
    url, model = tiny_api
    with openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60) as client:
        chat = client.chat.completions.create(model=model, temperature=0, max_tokens=10, messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}])
        whole = client.responses.create(model=model, temperature=0, max_output_tokens=10,
                                        instructions="Be brief.", input="Name a river.")
        with client.responses.stream(model=model, temperature=0, max_output_tokens=10, instructions="Be brief.",
                                     input="Name a river.") as stream:
            events = list(stream)
    kinds = [event.type for event in events]
    streamed = events[-1].response  # response.incomplete at max_output_tokens, as OpenAI ends it
    text = chat.choices[0].message.content
    assert whole.output_text == text and streamed.output_text == text and text
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert streamed.status == whole.status and streamed.id != whole.id
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds and kinds.index("response.output_item.added") < kinds.index(
        "response.output_text.delta") < kinds.index("response.output_text.done") < kinds.index(
        "response.output_item.done")


def test_previous_response_id_get_and_delete_stay_within_one_key(tiny_api):
    url, model = tiny_api
    with openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60) as client:
        first = client.responses.create(model=model, temperature=0, max_output_tokens=6, input="Hello.")
        follow = client.responses.create(model=model, temperature=0, max_output_tokens=6, input="And then?",
                                         previous_response_id=first.id)
        got = client.responses.retrieve(first.id)
        client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError, match="previous_response_id"):
            client.responses.create(model=model, input="x", previous_response_id=first.id)
        unstored = client.responses.create(model=model, max_output_tokens=2, input="x", store=False)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unstored.id)
    assert got.id == first.id and got.output_text == first.output_text
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens  # the first exchange is in its prompt


def test_a_function_calling_round_trip_through_the_client():
    generator = CannedGenerator(lambda request, i: "It is sunny in Paris." if i == 1 else CALL)
    with served(generator) as url, openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=30) as client:
        asked = client.responses.create(model="fake", input="Weather in Paris?", tools=[WEATHER])
        (call,) = [item for item in asked.output if item.type == "function_call"]
        answer = client.responses.create(model="fake", tools=[WEATHER], previous_response_id=asked.id, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 18 C"}])
        with client.responses.stream(model="fake", input="Weather in Paris?", tools=[WEATHER]) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_response()
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and asked.output_text == ""
    assert answer.output_text == "It is sunny in Paris."
    prompt = bytes(generator.requests[1].prompt_ids).decode()
    assert "Weather in Paris?" in prompt and '"get_weather"' in prompt and "sunny, 18 C" in prompt
    (streamed_call,) = [item for item in streamed.output if item.type == "function_call"]
    assert json.loads(streamed_call.arguments) == {"city": "Paris"}
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds


def test_text_format_json_schema_constrains_the_output_through_the_same_grammar(tiny_api):
    url, model = tiny_api
    schema = {"type": "object", "properties": {"river": {"enum": ["Nile", "Rhine"]}}, "required": ["river"],
              "additionalProperties": False}
    with openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60) as client:
        answer = client.responses.create(model=model, max_output_tokens=64, input="Name a river.",
                                         text={"format": {"type": "json_schema", "name": "river", "schema": schema}})
    assert answer.status == "completed" and json.loads(answer.output_text)["river"] in ("Nile", "Rhine")
    assert answer.text.format.type == "json_schema"


def test_models_lists_what_each_model_can_do(tiny_api):
    url, model = tiny_api
    with openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60) as client:
        (entry,) = client.models.list().data
    capabilities = entry.model_extra["capabilities"]
    assert entry.id == model and capabilities["chat"] and capabilities["responses"]
    assert capabilities["embeddings"] is False and capabilities["thinking"] is False  # the tiny model's template
    assert capabilities["structured_output"] is True  # the paged coordinator with the export's tokenizer


def test_penalties_and_samplers_pass_through_to_the_chat_request():
    params = parse_response_request({"input": "x", "frequency_penalty": 0.5, "repeat_penalty": 1.2, "top_k": 5,
                                     "seed": 3}, None, pending=frozenset())
    assert params.chat.sampling.top_k == 5 and params.chat.sampling.seed == 3
    with pytest.raises(ApiError) as caught:
        parse_response_request({"input": "x", "presence_penalty": 9}, None, pending=frozenset())
    assert caught.value.param == "presence_penalty"
