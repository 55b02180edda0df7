"""The grammar engine on real llguidance and real tokenizers: a model that knows nothing (random
logits), constrained by the mask, only ever writes JSON its schema accepts; rollback and draft masks
leave the matcher where it was; the mask covers a logits width wider than the tokenizer; EOS comes
exactly when the JSON is complete."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import numpy as np
import pytest
from openai.lib._parsing._completions import type_to_response_format_param
from pydantic import BaseModel, Field

from engine.generation.grammar import (
    GrammarError,
    GrammarStateError,
    GrammarTokenizer,
    apply_mask,
    fill_masks,
    load_grammar_tokenizer,
    mask_width,
    unpack_mask,
)
from engine.generation.request import FunctionSchema, JsonConstraint, ToolCallConstraint
from engine.generation.response_format import (
    ToolCallTemplate,
    constraint_grammar,
    json_schema_grammar,
    response_format_grammar,
    tool_call_grammar,
)
from engine.generation.tool_calls import FunctionTool, ToolChoice, ToolMode, parse_tool_calls, tool_constraint
from tests.generation.grammar_helpers import Vocab, decode, vocab_of

# Bounded schemas: every string, number and array has a length limit and objects take no extra
# keys, so a random walk through the grammar ends within the budget.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"$ref": "#/$defs/item"}},
                   "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]}},
    "required": ["items", "note"],
    "additionalProperties": False,
    "$defs": {"item": {"type": "object",
                       "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                      "ok": {"type": "boolean"}, "kind": {"const": "box"}},
                       "required": ["id", "ok", "kind"], "additionalProperties": False}},
}
CHOICE = {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"enum": ["none", "some"]}, {"type": "null"}]}
SCHEMAS = {"person": PERSON, "order": ORDER, "choice": CHOICE}


def _format(name: str, schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


TINY_LOGITS = 512  # the tiny models' vocab_size; their trained tokenizer has fewer tokens


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer_dir) -> Vocab:
    return vocab_of(tiny_tokenizer_dir, TINY_LOGITS)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_logits_under_the_mask_always_give_valid_json(tiny, name, temperature):
    grammar = response_format_grammar(_format(name, SCHEMAS[name]))
    for seed in range(12):
        matcher = tiny.grammar.matcher(grammar)
        out = decode(tiny, matcher, seed, temperature=temperature)
        assert out.stopped, f"seed {seed}: no EOS within the budget: {tiny.decode(out.ids)!r}"
        text = tiny.decode(out.ids)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
        assert matcher.is_stopped and matcher.stop_reason in ("EndOfSentence", "NoExtension")


def test_json_object_gives_an_object_whenever_it_stops(tiny):
    grammar = response_format_grammar({"type": "json_object"})
    stopped = 0
    for seed in range(20):
        matcher = tiny.grammar.matcher(grammar)
        out = decode(tiny, matcher, seed, budget=120)
        if out.stopped:
            stopped += 1
            assert isinstance(json.loads(tiny.decode(out.ids)), dict)
        else:  # cut by the budget: a prefix of an object, never anything else
            assert tiny.decode(out.ids).startswith("{")
    assert stopped > 0


def test_the_layout_is_the_one_json_dumps_writes(tiny):
    matcher = tiny.grammar.matcher(response_format_grammar(_format("person", PERSON)))
    text = tiny.decode(decode(tiny, matcher, 3).ids)
    assert text == json.dumps(json.loads(text), ensure_ascii=False)


def test_eos_is_allowed_exactly_when_the_json_is_complete(tiny):
    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    matcher = tiny.grammar.matcher(grammar)
    allowed = unpack_mask(matcher.mask(), tiny.grammar.logits_width)
    assert not allowed[tiny.eos_id] and not matcher.is_accepting
    matcher.consume(tiny.text.encode('{"a": 12').ids)
    assert not unpack_mask(matcher.mask(), tiny.grammar.logits_width)[tiny.eos_id]
    matcher.consume(tiny.text.encode("}").ids)
    assert matcher.is_accepting and matcher.is_stopped
    only = np.flatnonzero(unpack_mask(matcher.mask(), tiny.grammar.logits_width))
    assert only.tolist() == [tiny.eos_id]  # nothing but EOS once the object is closed
    matcher.consume([tiny.eos_id])
    assert matcher.is_stopped and matcher.stop_reason == "NoExtension"  # stopped before EOS; stays so


def test_eos_ends_a_value_that_could_go_on(tiny):
    matcher = tiny.grammar.matcher(json_schema_grammar({"type": "integer"}))
    matcher.consume(tiny.text.encode("12").ids + [tiny.eos_id])
    assert matcher.is_stopped and matcher.stop_reason == "EndOfSentence"


def test_a_number_may_go_on_or_end(tiny):
    matcher = tiny.grammar.matcher(json_schema_grammar({"type": "integer"}))
    matcher.consume(tiny.text.encode("12").ids)
    assert matcher.is_accepting and not matcher.is_stopped
    allowed = unpack_mask(matcher.mask(), tiny.grammar.logits_width)
    assert allowed[tiny.eos_id] and allowed[tiny.text.token_to_id("3")]


def test_rollback_returns_to_the_same_mask(tiny):
    matcher = tiny.grammar.matcher(response_format_grammar(_format("person", PERSON)))
    head, tail = tiny.text.encode('{"name": "Ann", ').ids, tiny.text.encode('"age": 4').ids
    matcher.consume(head)
    before = matcher.mask()
    matcher.consume(tail)
    assert not np.array_equal(matcher.mask(), before)
    matcher.rollback(len(tail))
    assert matcher.consumed == len(head)
    np.testing.assert_array_equal(matcher.mask(), before)
    with pytest.raises(GrammarStateError, match="cannot roll back"):
        matcher.rollback(len(head) + 1)
    matcher.consume(tail)  # still usable after the refused rollback
    assert matcher.consumed == len(head) + len(tail)


def test_draft_masks_match_stepping_and_do_not_advance(tiny):
    matcher = tiny.grammar.matcher(response_format_grammar(_format("person", PERSON)))
    matcher.consume(tiny.text.encode('{"name": "').ids)
    draft = tiny.text.encode('Bo", "age": 7').ids
    start = matcher.mask()
    masks = matcher.draft_masks(draft)
    assert masks.shape == (len(draft) + 1, tiny.grammar.mask_width)
    np.testing.assert_array_equal(matcher.mask(), start)  # not advanced
    stepping = tiny.grammar.matcher(matcher.grammar)
    stepping.consume(tiny.text.encode('{"name": "').ids)
    for i, token in enumerate(draft):
        np.testing.assert_array_equal(masks[i], stepping.mask())
        stepping.consume([token])
    np.testing.assert_array_equal(masks[-1], stepping.mask())


def test_a_draft_the_grammar_refuses_repeats_the_last_valid_mask(tiny):
    matcher = tiny.grammar.matcher(json_schema_grammar({"type": "boolean"}))
    draft = tiny.text.encode("tx").ids  # "t" may start true; "x" may not follow
    masks = matcher.draft_masks(draft + draft)
    np.testing.assert_array_equal(masks[2], masks[1])
    np.testing.assert_array_equal(masks[-1], masks[1])
    assert matcher.consumed == 0 and matcher.allows(tiny.text.token_to_id("t"))


def test_a_refused_token_is_not_consumed(tiny):
    matcher = tiny.grammar.matcher(json_schema_grammar({"type": "object"}))
    matcher.consume(tiny.text.encode("{").ids)
    bad = tiny.text.encode("x").ids
    with pytest.raises(GrammarStateError, match="not allowed by the JSON schema"):
        matcher.consume(tiny.text.encode('"a"').ids + bad)  # a key, then no colon
    assert matcher.consumed == 1  # all or nothing
    matcher.consume(tiny.text.encode("}").ids)
    assert matcher.is_stopped


def test_the_mask_covers_a_logits_width_wider_than_the_tokenizer(tiny_tokenizer_dir, tiny):
    words = tiny.text.get_vocab_size(with_added_tokens=True)
    assert words < TINY_LOGITS  # the tiny model is itself the padded case
    wide_width = TINY_LOGITS + 45  # and wider again, not a multiple of 32
    wide = vocab_of(tiny_tokenizer_dir, wide_width)
    assert wide.grammar.mask_width == mask_width(wide_width) == -(-wide_width // 32)
    grammar = response_format_grammar(_format("order", ORDER))
    matcher = wide.grammar.matcher(grammar)
    for _ in range(40):
        mask = matcher.mask()
        assert mask.shape == (wide.grammar.mask_width,)
        bits = unpack_mask(mask, wide_width)
        assert not bits[words:].any()  # ids past the tokenizer are never allowed
        logits = np.zeros(wide_width, np.float32)
        logits[words:] = 1e6  # the padding would win unmasked
        token = int(np.argmax(apply_mask(logits + bits, mask)))
        if token == wide.eos_id:
            break
        matcher.consume([token])


def test_a_logits_width_narrower_than_the_tokenizer_is_refused(tiny_tokenizer_dir, tiny):
    with pytest.raises(GrammarStateError, match="does not fit a model with 100 logits"):
        GrammarTokenizer((tiny_tokenizer_dir / "tokenizer.json").read_text(), logits_width=100, eos_ids=[2])
    with pytest.raises(GrammarStateError, match="outside the logits width"):
        GrammarTokenizer((tiny_tokenizer_dir / "tokenizer.json").read_text(), logits_width=600, eos_ids=[600])
    with pytest.raises(GrammarStateError, match="cannot read this tokenizer.json"):
        GrammarTokenizer('{"model": {"type": "Nothing"}}', logits_width=600, eos_ids=[2])
    with pytest.raises(GrammarStateError, match="end-of-sequence"):
        GrammarTokenizer((tiny_tokenizer_dir / "tokenizer.json").read_text(), logits_width=600, eos_ids=[])


def test_the_tokenizer_is_built_once_per_model(tiny_tokenizer_dir, tiny):
    again = load_grammar_tokenizer(tiny_tokenizer_dir / "tokenizer.json", logits_width=tiny.grammar.logits_width,
                                   eos_ids=[tiny.eos_id])
    assert again is tiny.grammar
    with pytest.raises(GrammarStateError, match="no tokenizer at"):
        load_grammar_tokenizer(tiny_tokenizer_dir / "nothing", logits_width=512, eos_ids=[2])


def test_fill_masks_writes_one_row_per_stream(tiny):
    grammars = [json_schema_grammar({"type": "boolean"}), json_schema_grammar({"type": "null"})]
    matchers = [tiny.grammar.matcher(g) for g in grammars]
    out = np.zeros((2, tiny.grammar.mask_width), np.uint32)
    fill_masks(matchers, out)
    for row, matcher in zip(out, matchers, strict=True):
        np.testing.assert_array_equal(row, matcher.mask())
    with pytest.raises(GrammarStateError, match="mask row"):
        matchers[0].fill_mask(np.zeros(tiny.grammar.mask_width, np.int64))


class _Address(BaseModel):
    city: str = Field(min_length=1, max_length=10)
    zip: str | None = Field(max_length=5)


class _Ticket(BaseModel):
    """A model as a client hands it to ``client.chat.completions.parse``."""

    title: str = Field(description="one line", max_length=12)
    priority: Literal["low", "high"]
    seats: int = Field(ge=1, le=9)
    addresses: list[_Address] = Field(max_length=2)
    urgent: bool | None


def test_what_the_openai_client_sends_for_a_pydantic_model_decodes_into_that_model(tiny):
    # The function parse() itself calls (a private module of the openai package): what is sent, strict.
    response_format = type_to_response_format_param(_Ticket)
    assert response_format["json_schema"]["strict"] is True
    grammar = response_format_grammar(response_format)
    for seed in range(10):
        out = decode(tiny, tiny.grammar.matcher(grammar), seed, temperature=1.0)
        assert out.stopped
        _Ticket.model_validate_json(tiny.decode(out.ids))


# -- tool calls --------------------------------------------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}


def _template(name: str, schema: dict) -> ToolCallTemplate:
    return ToolCallTemplate(name, schema, f'<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>")


def test_a_named_tool_call_has_its_frame_and_valid_arguments(tiny):
    grammar = tool_call_grammar([_template("get_weather", WEATHER)])
    for seed in range(8):
        out = decode(tiny, tiny.grammar.matcher(grammar), seed)
        assert out.stopped
        text = tiny.decode(out.ids)
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
        call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        assert call["name"] == "get_weather"
        jsonschema.validate(call["arguments"], WEATHER)


def test_required_calls_one_of_the_tools_up_to_max_calls(tiny):
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    grammar = tool_call_grammar([_template(n, s) for n, s in schemas.items()], max_calls=3)
    counts = set()
    for seed in range(16):
        out = decode(tiny, tiny.grammar.matcher(grammar), seed, temperature=1.0)
        assert out.stopped
        blocks = tiny.decode(out.ids).split("\n</tool_call>")
        assert blocks[-1] == ""
        counts.add(len(blocks) - 1)
        for block in blocks[:-1]:
            call = json.loads(block.removeprefix("\n").removeprefix("<tool_call>\n"))
            jsonschema.validate(call["arguments"], schemas[call["name"]])
    assert counts <= {1, 2, 3} and len(counts) > 1


def test_a_tool_whose_schema_cannot_compile_is_named():
    with pytest.raises(GrammarError, match="parameters of function 'broken'.*objekt"):
        tool_call_grammar([_template("get_time", TIME), _template("broken", {"type": "objekt"})])
    with pytest.raises(GrammarError, match="at least one function"):
        tool_call_grammar([])
    with pytest.raises(GrammarError, match="max_calls"):
        tool_call_grammar([_template("get_time", TIME)], max_calls=0)


# -- the default model's vocabulary (slow lane: the embedded model) -------------------------------


@pytest.mark.slow
def test_default_model_vocabulary_gives_valid_json(default_tokenizer_dir):
    vocab = vocab_of(default_tokenizer_dir)
    assert vocab.grammar.logits_width == 49152 and vocab.grammar.mask_width == 1536
    for name, schema in SCHEMAS.items():
        grammar = response_format_grammar(_format(name, schema))
        for seed in range(4):
            out = decode(vocab, vocab.grammar.matcher(grammar), seed)
            assert out.stopped, name
            jsonschema.validate(json.loads(vocab.decode(out.ids)), schema)


# -- the request's constraint, as the API carries it -------------------------------------------------


def test_a_forced_tool_choice_decodes_into_calls_the_api_parses(tiny):
    tools = [FunctionTool("get_weather", "", json.dumps(WEATHER)), FunctionTool("get_time", "", json.dumps(TIME))]
    for choice in (ToolChoice(ToolMode.REQUIRED), ToolChoice(ToolMode.FUNCTION, "get_time")):
        constraint = tool_constraint(tools, choice)
        grammar = constraint_grammar(constraint)
        assert constraint_grammar(constraint) is grammar  # compiled once per constraint
        for seed in range(6):
            out = decode(tiny, tiny.grammar.matcher(grammar), seed, temperature=1.0)
            assert out.stopped
            content, calls = parse_tool_calls(tiny.decode(out.ids))
            assert not content and len(calls) == 1
            if choice.mode is ToolMode.FUNCTION:
                assert calls[0].name == "get_time"
            schema = {"get_weather": WEATHER, "get_time": TIME}[calls[0].name]
            jsonschema.validate(json.loads(calls[0].arguments), schema)


def test_a_json_constraint_compiles_as_its_response_format(tiny):
    assert constraint_grammar(JsonConstraint()).description == "response_format json_object"
    grammar = constraint_grammar(JsonConstraint(json.dumps(PERSON), "person", strict=True))
    assert grammar.description == "response_format json_schema 'person'"
    out = decode(tiny, tiny.grammar.matcher(grammar), 1)
    jsonschema.validate(json.loads(tiny.decode(out.ids)), PERSON)
    with pytest.raises(GrammarError, match="response_format.json_schema.schema cannot .*Invalid type: objekt"):
        constraint_grammar(JsonConstraint('{"type": "objekt"}', "bad"))
    with pytest.raises(GrammarError, match="parameters of function 'f' is not JSON"):
        constraint_grammar(ToolCallConstraint((FunctionSchema("f", "{nope"),)))
