"""Tool calls (issue 17): the generic format a template without tools gets, parsing the model's
answer into calls (whole and streamed, on canned outputs: a small model's free choice under
``auto`` is luck), and the real ``openai`` client and LangChain reading our tool-call answers
(non-streamed, streamed, and the round trip with the tool's result)."""

from __future__ import annotations

import json

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.api.openai_schema import ApiError, parse_completion
from engine.errors import TokenizerError
from engine.generation.tokenizer import ChatTokenizer
from engine.generation.tool_calls import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    FunctionTool,
    ToolCallStream,
    ToolChoice,
    ToolMode,
    conversation,
    parse_tool_calls,
    tool_constraint,
)
from tests.support.canned_api import CannedGenerator, served
from tests.support.tiny_models import build_tiny_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


# -- parsing canned outputs ------------------------------------------------------------------------

@pytest.mark.parametrize("text, content, calls", [
    (CALL, None, [("get_weather", {"city": "Paris"})]),
    ("Let me look.\n" + CALL, "Let me look.", [("get_weather", {"city": "Paris"})]),
    (TWO_CALLS, None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>', None,
     [("get_weather", {"city": "Oslo"})]),  # arguments as a JSON string
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
    ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),  # stays text
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>\n{"name": "get_weather", "argu', '<tool_call>\n{"name": "get_weather", "argu', []),  # cut off
    ("a < b <tool", "a < b <tool", []),
])
def test_auto_parsing_of_canned_outputs(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls) and len({c.id for c in got_calls}) == len(got_calls)


@settings(max_examples=200, deadline=None)
@given(text=st.sampled_from([CALL, TWO_CALLS, "Sure. " + CALL + " Done.", "<tool_call>x</tool_call>", "plain <to"]),
       cuts=st.lists(st.integers(0, 200), max_size=12))
def test_streamed_parsing_equals_the_whole_parse_at_any_split(text, cuts):
    stream, pieces, at = ToolCallStream(), [], 0
    for cut in sorted(set(cuts)):
        pieces += stream.push(text[at:cut])
        at = max(at, cut)
    pieces += [*stream.push(text[at:]), *stream.finish()]
    content, calls = parse_tool_calls(text)
    streamed = "".join(p.text for p in pieces if isinstance(p, ContentDelta))
    assert (streamed.strip() or None if calls else streamed) == content
    starts = [p for p in pieces if isinstance(p, CallStart)]
    assert [(s.index, s.name) for s in starts] == [(i, c.name) for i, c in enumerate(calls)]
    for s, call in zip(starts, calls, strict=True):  # name first, then the arguments in fragments
        fragments = [p.fragment for p in pieces if isinstance(p, ArgumentsDelta) and p.index == s.index]
        assert json.loads("".join(fragments)) == json.loads(call.arguments)
        assert pieces.index(s) < min(i for i, p in enumerate(pieces) if isinstance(p, ArgumentsDelta)
                                     and p.index == s.index)


# -- what the model is told --------------------------------------------------------------------

def tools_of(*raw) -> tuple[FunctionTool, ...]:
    return parse_completion({"messages": [{"role": "user", "content": "x"}], "tools": list(raw)}, "chat").tools


def test_generic_format_describes_the_tools_and_writes_the_round_trip_as_text():
    history = parse_completion({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]}, "chat").messages
    tools = tools_of(WEATHER, CLOCK)
    messages, native_tools = conversation(history, tools, ToolChoice(), native=False)
    assert native_tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n") and '"name":"get_weather"' in messages[0]["content"]
    assert "<tool_call>" in messages[0]["content"] and '"get_time"' in messages[0]["content"]
    assert json.loads(messages[2]["content"].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")) == {
        "name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[3]["content"] == "<tool_response>\n18 C, sunny\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in messages)
    # none: the tools are not shown; no system message: one is added first
    assert conversation(history[1:2], tools, ToolChoice(ToolMode.NONE), native=False)[0] == [history[1]]
    forced, _ = conversation(history[1:2], tools, ToolChoice(ToolMode.FUNCTION, "get_time"), native=False)
    assert forced[0]["role"] == "system" and "You must call the function 'get_time'" in forced[0]["content"]


def tokenizer_with_template(root, template: str) -> ChatTokenizer:
    config = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return ChatTokenizer(root)


TOOL_TEMPLATE = (  # reads ``tools`` and the calls' arguments as objects, as Qwen's and Hermes' templates do
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}"
    "{% endfor %}<assistant>")


@pytest.mark.slow
def test_the_default_models_template_takes_no_tools(default_checkpoint):
    tokenizer = ChatTokenizer(default_checkpoint)
    assert tokenizer.chat_template and not tokenizer.takes_tools  # so it gets the generic format


def test_templates_that_take_tools_get_them_and_the_tiny_ones_do_not(tmp_path):
    root = build_tiny_tokenizer(tmp_path / "tok")
    assert not ChatTokenizer(root).takes_tools  # the tiny test models'
    tokenizer = tokenizer_with_template(root, TOOL_TEMPLATE)
    assert tokenizer.takes_tools
    history = parse_completion({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]}, "chat").messages
    messages, tools = conversation(history, tools_of(WEATHER, CLOCK), ToolChoice(), native=True)
    assert tokenizer.render_chat(messages, tools=tools) == (
        "<tools>get_weather;get_time;</tools><user>Weather?<assistant>[call get_weather Oslo]<tool>cold<assistant>")
    with pytest.raises(TokenizerError, match="does not take tools"):
        tokenizer_with_template(root, "{% for m in messages %}{{ m.content }}{% endfor %}").render_chat(
            messages, tools=tools)


def test_a_forced_choice_becomes_the_call_constraint():
    tools = tools_of(WEATHER, CLOCK)
    assert tool_constraint(tools, ToolChoice()) is None and tool_constraint(tools, ToolChoice(ToolMode.NONE)) is None
    named = tool_constraint(tools, ToolChoice(ToolMode.FUNCTION, "get_weather"))
    assert [f.name for f in named.functions] == ["get_weather"]
    assert json.loads(named.functions[0].parameters) == WEATHER["function"]["parameters"]
    assert (named.opening, named.closing) == ("<tool_call>\n", "\n</tool_call>")
    assert [f.name for f in tool_constraint(tools, ToolChoice(ToolMode.REQUIRED)).functions] == ["get_weather",
                                                                                                 "get_time"]
    params = parse_completion({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                               "tool_choice": "required"}, "chat", pending=())
    assert params.constraint == tool_constraint(params.tools, ToolChoice(ToolMode.REQUIRED))


@pytest.mark.parametrize("patch, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),  # honoured once the grammar is wired
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages"),  # no tool_call_id
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]}, "messages"),
])
def test_bad_tool_fields_are_400_naming_the_field(patch, param):
    with pytest.raises(ApiError) as info:
        parse_completion({"messages": [{"role": "user", "content": "x"}], **patch}, "chat")
    assert (info.value.status, info.value.param) == (400, param)


# -- the real clients reading our answers ------------------------------------------------------

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_openai_client_reads_tool_calls_non_streamed_and_streamed_and_sends_the_result_back():
    generator = CannedGenerator(lambda request, i: CALL if i < 2 else "It is 18 C and sunny in Paris.")
    with served(generator) as url, openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=30) as client:
        plain = client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER, CLOCK])
        with client.chat.completions.stream(model="fake", messages=ASK, tools=[WEATHER, CLOCK]) as stream:
            streamed = stream.get_final_completion()
        call = plain.choices[0].message.tool_calls[0]
        history = [*ASK, plain.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
        final = client.chat.completions.create(model="fake", messages=history, tools=[WEATHER, CLOCK])
    for answer in (plain, streamed):
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content  # streamed: ""
        (got,) = choice.message.tool_calls
        assert got.type == "function" and got.id.startswith("call_") and got.function.name == "get_weather"
        assert json.loads(got.function.arguments) == {"city": "Paris"}
    assert final.choices[0].message.content == "It is 18 C and sunny in Paris."
    assert final.choices[0].finish_reason == "stop" and final.choices[0].message.tool_calls is None
    prompt = bytes(generator.requests[2].prompt_ids).decode()
    assert '"name": "get_weather"' in prompt and "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    assert "<tools>" in prompt and generator.requests[2].constraint is None


def test_tool_choice_none_returns_the_text_as_content():
    with served(CannedGenerator(CALL)) as url, openai.OpenAI(base_url=url, api_key="x", max_retries=0) as client:
        answer = client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER], tool_choice="none")
    assert answer.choices[0].message.content == CALL and answer.choices[0].finish_reason == "stop"


def test_langchain_bind_tools_reads_our_calls():
    langchain_openai = pytest.importorskip("langchain_openai")

    def get_weather(city: str) -> str:
        """The weather in a city now."""
        return "sunny"

    with served(CannedGenerator(CALL)) as url:
        chat = langchain_openai.ChatOpenAI(base_url=url, api_key="x", model="fake", max_retries=0, timeout=30)
        message = chat.bind_tools([get_weather]).invoke("What is the weather in Paris?")
        streamed = None
        for chunk in chat.bind_tools([get_weather]).stream("What is the weather in Paris?"):
            streamed = chunk if streamed is None else streamed + chunk
    for got in (message, streamed):
        assert [(c["name"], c["args"]) for c in got.tool_calls] == [("get_weather", {"city": "Paris"})]
