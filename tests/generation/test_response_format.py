"""OpenAI ``response_format`` to a grammar: the valid forms compile, every malformed one is a
GrammarError naming the field at fault and llguidance's reason (the API's 400)."""

from __future__ import annotations

import llguidance
import pytest

from engine.generation.grammar import GrammarError, check_grammar
from engine.generation.response_format import json_schema_grammar, response_format_grammar


def _schema(schema, strict=None, name="answer") -> dict:
    spec = {"name": name, "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def test_text_and_absent_are_no_constraint():
    assert response_format_grammar(None) is None
    assert response_format_grammar({"type": "text"}) is None


def test_the_valid_forms_compile_and_say_what_they_are():
    assert response_format_grammar({"type": "json_object"}).description == "response_format json_object"
    grammar = response_format_grammar(_schema({"type": "object", "properties": {"a": {"type": "string"}}}, True))
    assert grammar.description == "response_format json_schema 'answer'" and grammar.warnings == ()
    no_schema = response_format_grammar({"type": "json_schema", "json_schema": {"name": "any"}})
    assert '"type":"object"' in no_schema.source.replace(" ", "")  # OpenAI's schema is optional
    assert response_format_grammar(_schema(True)) is not None


BAD = [
    ("x", "response_format must be an object"),
    ({"type": "xml"}, "response_format.type must be one of text, json_object, json_schema; got 'xml'"),
    ({}, "response_format.type must be one of"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name must be"),
    (_schema({}, name="has space"), "json_schema.name must be 1-64"),
    (_schema({}, name="x" * 65), "json_schema.name must be 1-64"),
    (_schema({}, strict="yes"), "json_schema.strict must be true or false"),
    (_schema([1, 2]), "response_format.json_schema.schema must be a JSON Schema object, got list"),
    (_schema(False), "response_format.json_schema.schema is false, which no value satisfies"),
    (_schema({"type": "objekt"}), "response_format.json_schema.schema cannot be used for constrained decoding: "
                                  "Invalid type: objekt"),
    (_schema({"$ref": "#/$defs/missing"}), "Pointer '/\\$defs/missing' does not exist"),
    (_schema({"type": "string", "pattern": "(?<=a)b"}), "look-around.*is not supported"),
    (_schema({"type": "object", "minProperties": "two"}), "minProperties"),
    (_schema({"not": {"type": "string"}}, strict=True), 'Unimplemented keys: \\["not"\\]'),
    (_schema({"type": "object", "properties": {"a": float("nan")}}), "schema"),
]


@pytest.mark.parametrize("response_format, message", BAD, ids=[m[:40] for _, m in BAD])
def test_a_malformed_response_format_names_the_problem(response_format, message):
    with pytest.raises(GrammarError, match=message):
        response_format_grammar(response_format)


def test_without_strict_unimplemented_keywords_are_skipped_and_listed():
    schema = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    for strict in (None, False):
        grammar = response_format_grammar(_schema(schema, strict))
        assert grammar.warnings == ('Unimplemented keys: ["not"]',)
    with pytest.raises(GrammarError, match="Unimplemented"):
        json_schema_grammar(schema, strict=True)


def test_the_client_cannot_loosen_the_layout():
    grammar = response_format_grammar(_schema({"type": "object", "x-guidance": {"whitespace_flexible": True}}))
    assert '"whitespace_flexible":false' in grammar.source.replace(" ", "")


def test_check_grammar_refuses_text_that_is_no_grammar():
    with pytest.raises(GrammarError, match='my grammar cannot be used for .*unknown name: "nope"'):
        check_grammar(llguidance.LLMatcher.grammar_from_lark("start: nope"), "my grammar")
