"""LangChain (``langchain_openai.ChatOpenAI``) against ``deskfleet serve`` on the tiny 2-stage export,
its stages in worker processes (``--workers``: the paged runtime, masks on the wire), one served
process for the module.

What LangChain does with our answers, beyond the ``openai`` client's view (tests/api/
test_constrained_api.py): ``with_structured_output`` by function calling (LangChain binds the
schema as a tool and forces it: our forced tool-call grammar) and with ``include_raw``, several
structured answers batched at once (constrained streams sharing steps), ``bind_tools`` with
``tool_choice="any"`` (sent as "required") non-streamed and streamed (LangChain assembles the
tool-call chunks), and the call and its result going back as AIMessage + ToolMessage.

The tiny model's weights are random, so a valid answer is the grammar's doing alone: the schemas
use enums and booleans, whose answers always finish within the token budget.
"""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel

from tests.support.api_helpers import serve_process

langchain_openai = pytest.importorskip("langchain_openai")
messages = pytest.importorskip("langchain_core.messages")

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
           "additionalProperties": False}
# One short tool: the generic tool block costs the tiny tokenizer most of the model's 512 positions,
# so no max_tokens is set (the server gives an answer the rest of the context).
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}}]


class Light(BaseModel):
    on: bool
    color: Literal["red", "amber", "green"]


class Lamp(BaseModel):  # as a tool: its call is ~60 tiny tokens after a ~400-token tool block
    on: bool


@pytest.fixture(scope="module")
def chat(tiny_export):
    with serve_process("--shards", str(tiny_export("llama", 2)), "--workers", "--exact",
                       "--model-name", "tiny") as url:
        yield langchain_openai.ChatOpenAI(base_url=url, api_key="unused", model="tiny", max_retries=0, timeout=120,
                                          temperature=0.8, seed=11)


def test_structured_output_by_function_calling_and_with_the_raw_message(chat):
    lamp = chat.with_structured_output(Lamp, method="function_calling", strict=True).invoke("On?")
    assert isinstance(lamp, Lamp)
    raw = chat.with_structured_output(Light, method="json_schema", strict=True, include_raw=True).invoke("The light?")
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], Light)
    assert Light.model_validate_json(raw["raw"].content) == raw["parsed"]
    assert raw["raw"].response_metadata["finish_reason"] == "stop"


def test_structured_answers_batched_together_are_each_valid(chat):
    asks = [f"Light number {i}?" for i in range(4)]
    lights = chat.with_structured_output(Light, method="json_schema", strict=True).batch(
        asks, config={"max_concurrency": 4})
    assert len(lights) == 4 and all(isinstance(light, Light) for light in lights)


def test_a_bound_tool_forced_with_any_non_streamed_streamed_and_answered(chat):
    bound = chat.bind_tools(TOOLS, tool_choice="any")
    message = bound.invoke("Weather?")
    (call,) = message.tool_calls
    assert call["name"] == "weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], WEATHER)
    assert message.response_metadata["finish_reason"] == "tool_calls"

    whole = None
    for chunk in bound.stream("Weather?"):
        whole = chunk if whole is None else whole + chunk
    assert whole is not None
    (streamed,) = whole.tool_calls
    assert streamed["name"] == "weather"
    jsonschema.validate(streamed["args"], WEATHER)

    history = [messages.HumanMessage("Weather?"), message,
               messages.ToolMessage(json.dumps({"forecast": "sun"}), tool_call_id=call["id"])]
    after = chat.invoke(history, max_tokens=8)
    assert after.response_metadata["finish_reason"] in ("stop", "length") and not after.tool_calls
