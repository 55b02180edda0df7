"""Constraints a request asks for, compiled to a :class:`~engine.generation.grammar.Grammar`.

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object) or ``{"type": "json_schema", "json_schema": {"name", "schema"?, "strict"?,
  "description"?}}``.
- A tool call whose arguments follow the function's JSON schema, inside the text the chat format
  puts around it (``tool_choice`` "required" or a named function): :func:`tool_call_grammar`.
- What a :class:`~engine.generation.request.GenerationRequest` carries (its ``constraint``, as the
  API parsed it): :func:`constraint_grammar`, the one call a generator makes.

The JSON is written in one fixed layout, the one ``json.dumps`` uses (``", "`` and ``": "``,
no newlines or indentation): a small model left free to choose whitespace can spend its whole
budget on it, and a fixed layout costs nothing in validity.

``strict``: true enforces every keyword and refuses a schema with one llguidance does not
implement (a 400 naming it); false or absent (OpenAI's default) skips those keywords and
enforces the rest, the skipped ones listed in ``Grammar.warnings``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from engine.generation.grammar import Grammar, GrammarError, check_grammar
from engine.generation.request import Constraint, JsonConstraint, ToolCallConstraint

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name
_MAX_CALLS = 16
# x-guidance options of every schema we compile (ours override the client's own).
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _options(strict: bool) -> dict[str, Any]:
    return {**_LAYOUT, "lenient": not strict}


def _schema_with_options(schema: Mapping[str, Any] | bool, strict: bool) -> dict[str, Any]:
    if isinstance(schema, bool):  # JSON Schema's true (false is refused by _check_schema)
        schema = {}
    return {**schema, "x-guidance": _options(strict)}


def _check_schema(schema: Any, field: str) -> Mapping[str, Any] | bool:
    if schema is False:
        raise GrammarError(f"{field} is false, which no value satisfies")
    if isinstance(schema, bool) or isinstance(schema, Mapping):
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise GrammarError(f"{field} is not JSON: {exc}") from exc
        return schema
    raise GrammarError(f"{field} must be a JSON Schema object, got {type(schema).__name__}")


def json_schema_grammar(schema: Mapping[str, Any] | bool, *, strict: bool = True,
                        description: str = "the JSON schema") -> Grammar:
    """Any JSON value valid for ``schema``. Raises :class:`GrammarError` naming ``description``."""
    schema = _check_schema(schema, description)
    try:
        source = llguidance.LLMatcher.grammar_from_json_schema(_schema_with_options(schema, strict))
    except ValueError as exc:
        raise GrammarError(f"{description} is not a JSON object: {exc}") from exc
    warnings = check_grammar(source, description)
    return Grammar(source=source, description=description, warnings=warnings)


def response_format_grammar(response_format: Mapping[str, Any] | None) -> Grammar | None:
    """The grammar an OpenAI ``response_format`` asks for; ``None`` for none or ``{"type": "text"}``.

    Raises :class:`GrammarError` whose message names the field at fault
    (``response_format.json_schema.schema: ...``).
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise GrammarError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise GrammarError(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, strict=True, description="response_format json_object")
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise GrammarError("response_format.json_schema must be an object with a name and a schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise GrammarError("response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'; "
                           f"got {name!r}")
    strict = spec.get("strict", False)
    if strict is None:
        strict = False
    if not isinstance(strict, bool):
        raise GrammarError(f"response_format.json_schema.strict must be true or false, got {strict!r}")
    schema = spec.get("schema", {"type": "object"})
    field = "response_format.json_schema.schema"
    _check_schema(schema, field)
    grammar = json_schema_grammar(schema, strict=strict, description=field)
    return Grammar(grammar.source, f"response_format json_schema {name!r}", grammar.warnings)


@dataclass(frozen=True)
class ToolCallTemplate:
    """One function a constrained reply may call: ``before`` + arguments JSON + ``after``.

    E.g. ``before='<tool_call>\\n{"name": "get_weather", "arguments": '``, ``after='}\\n</tool_call>'``.
    The texts are matched as text (special tokens by their spelling); ``name`` names the
    function in messages only.
    """

    name: str
    arguments_schema: Mapping[str, Any] | bool
    before: str
    after: str


def _json_text(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _lark_text(text: str) -> str:
    return _json_text(text) if text else ""


def tool_call_grammar(calls: Sequence[ToolCallTemplate], *, max_calls: int = 1, separator: str = "\n",
                      strict: bool = False) -> Grammar:
    """One call of any of ``calls`` (``tool_choice`` "required"; pass one template for a named
    function), or up to ``max_calls`` of them joined by ``separator`` (parallel tool calls).
    ``strict`` as a function's ``strict`` in OpenAI's ``tools`` (default false).

    Raises :class:`GrammarError` naming the function whose schema cannot be compiled.
    """
    if not calls:
        raise GrammarError("a tool-call constraint needs at least one function")
    if not 1 <= max_calls <= _MAX_CALLS:
        raise GrammarError(f"max_calls must be between 1 and {_MAX_CALLS}, got {max_calls}")
    rules = []
    for i, call in enumerate(calls):
        field = f"the parameters of function {call.name!r}"
        schema = _schema_with_options(_check_schema(call.arguments_schema, field), strict)
        json_schema_grammar(call.arguments_schema, strict=strict, description=field)  # names a bad schema
        rules.append(f"call_{i}: {_lark_text(call.before)} %json {json.dumps(schema)} {_lark_text(call.after)}")
    start = "start: call" if max_calls == 1 else f"start: call ({_lark_text(separator)} call){{0,{max_calls - 1}}}"
    lark = "\n".join([start, "call: " + " | ".join(f"call_{i}" for i in range(len(calls))), *rules])
    source = llguidance.LLMatcher.grammar_from_lark(lark)
    names = ", ".join(repr(c.name) for c in calls)
    description = f"the tool call to {names}" if len(calls) == 1 else f"a tool call to one of {names}"
    return Grammar(source=source, description=description, warnings=check_grammar(source, description))


def _loads(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise GrammarError(f"{field} is not JSON: {exc}") from exc


@functools.lru_cache(maxsize=64)  # n choices, and clients repeating one schema, compile it once
def constraint_grammar(constraint: Constraint) -> Grammar:
    """The grammar of a request's ``constraint``. A tool call is ``opening`` +
    ``{"name": N, "arguments": A}`` + ``closing`` for one of its functions, A valid for N's
    parameters (the layout of the JSON around A as :mod:`engine.generation.tool_calls` writes it).

    Raises :class:`GrammarError` naming the schema or function at fault (the API's 400).
    """
    if isinstance(constraint, JsonConstraint):
        if constraint.schema is None:
            return json_schema_grammar({"type": "object"}, description="response_format json_object")
        field = "response_format.json_schema.schema"
        grammar = json_schema_grammar(_loads(constraint.schema, field), strict=constraint.strict, description=field)
        return Grammar(grammar.source, f"response_format json_schema {constraint.name!r}", grammar.warnings)
    if isinstance(constraint, ToolCallConstraint):
        calls = [ToolCallTemplate(f.name, _loads(f.parameters, f"the parameters of function {f.name!r}"),
                                  f'{constraint.opening}{{"name": {_json_text(f.name)}, "arguments": ',
                                  "}" + constraint.closing)
                 for f in constraint.functions]
        return tool_call_grammar(calls)
    raise GrammarError(f"unknown constraint {type(constraint).__name__}")
