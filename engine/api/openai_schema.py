"""Stage 1 of a request, parse: the OpenAI request body in, a typed frozen request out.

A completion request is read in one direction: parse (here) → admit (:mod:`engine.api.admit`) →
generate (:mod:`engine.api.generate`) → shape (:mod:`engine.api.openai_answer`); the route handler
(:mod:`engine.api.server`) strings them together, and no stage calls back into an earlier one.

:func:`parse_json_body` decodes the body, :func:`parse_completion` validates a /v1/chat/completions
or /v1/completions body into :class:`CompletionParams` (model, messages or prompt, sampling with its
penalties, ``min_p`` and ``logit_bias``, stop,
stream options, ``n``, ``logprobs``/``top_logprobs``, ``tools``/``tool_choice``,
``response_format``, ``reasoning_effort``) and :func:`check_prompt_chars` refuses, unread, a
prompt far longer than the server could ever take. Invalid input raises
:class:`~engine.api.api_error.ApiError` (400 naming the field, 404 for a model not served). The
checks that need the model's tokenizer or card (the prompt's length in tokens, its ids within the
vocabulary) are the generate stage's, which tokenises. No sockets and no aiohttp here.

A feature the parser knows but the generators behind the server do not honour yet is refused
with a 400 naming its field (``pending``, :data:`NOT_YET_SERVED`) rather than ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.api.api_error import ApiError, bad_request, model_not_found
from engine.errors import GenerationError
from engine.generation.penalties import PENALTY_FEATURES
from engine.generation.reasoning import ReasoningEffort
from engine.generation.request import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    PENALTY_LIMIT,
    REPETITION_PENALTY_MAX,
    Constraint,
    JsonConstraint,
    SamplingParams,
)
from engine.generation.tool_calls import (
    EMPTY_PARAMETERS,
    FunctionTool,
    ToolCall,
    ToolChoice,
    ToolMode,
    compact_json,
    tool_constraint,
)

MAX_STOP_STRINGS = 4
MAX_CHOICES = 8  # n: each choice is a stream of its own on the ring
MAX_TOOLS = 128
MAX_TOKEN_ID = (1 << 31) - 1  # a prompt's ids are int32 to the model; the tokenizer's vocabulary bounds them further
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# Fields a client may send that this server cannot honour: refuse them rather than ignore them.
UNSUPPORTED = ("functions", "function_call", "echo", "suffix")
# Features parsed and carried on the request that not every generator honours: the paged, stateful
# and static (NPU) runtimes do (their coordinators' ``features``), the constrained ones only when
# started with the model's tokenizer.json. Refused with a 400 naming the field where the serving
# generator does not honour them (engine.api.server.ApiSettings.pending). feature -> (field, why)
_RUNTIMES = ("the generator serving this model does not; Deskfleet's coordinators do when started with the "
             "export's tokenizer/tokenizer.json")
NOT_YET_SERVED: Mapping[str, tuple[str, str]] = {
    "logprobs": ("logprobs", f"log-probabilities are not returned by the runtime serving this model ({_RUNTIMES})"),
    "response_format": ("response_format", "constrained JSON output is not enforced by the runtime serving this "
                                           f"model ({_RUNTIMES}); ask for JSON in the prompt instead"),
    "forced_tool_call": ("tool_choice", "a required or named tool_choice needs constrained decoding, which the "
                                        f"runtime serving this model does not do ({_RUNTIMES}); use 'auto'"),
    **{name: (name, "penalties and logit_bias are not applied by the runtime serving this model (a static NPU "
                    "export decodes from its last stage's top-1; the paged runtime of CPU/GPU exports applies them); "
                    "leave it out") for name in sorted(PENALTY_FEATURES)},
}
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


CHARS_PER_TOKEN = 8  # no tokenizer makes fewer than one token per this many characters of natural text


# -- request parsing ---------------------------------------------------------------------------

@dataclass(frozen=True)
class CompletionParams:
    """A validated chat or completions request; ``prompt`` is text or token ids for "text"."""

    kind: str  # "chat" or "text"
    model: str | None = None  # the requested model; None: the server's first (the router resolves it)
    # role, content (always text); an assistant's earlier "tool_calls" (ToolCall), a tool's "tool_call_id"
    messages: tuple[dict[str, Any], ...] = ()
    prompt: str | tuple[int, ...] = ""
    max_tokens: int | None = None  # None: the server default, clipped to the context
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices, each generated on its own (seed + i when seeded)
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely tokens' (0..20)
    response_format: JsonConstraint | None = None  # None: free text
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    reasoning_effort: ReasoningEffort | None = None  # None: the template's default

    @property
    def parses_tools(self) -> bool:
        """Whether the answer's text is parsed for tool calls (tools given, and not ``none``)."""
        return bool(self.tools) and self.tool_choice.mode is not ToolMode.NONE

    @property
    def callable_tools(self) -> frozenset[str]:
        """The function names an answer's tool calls may name (empty: its text is not parsed for calls)."""
        return frozenset(t.name for t in self.tools) if self.parses_tools else frozenset()

    @property
    def constraint(self) -> Constraint | None:
        """What the generators must constrain the output to: a forced tool call, else the response format."""
        return tool_constraint(self.tools, self.tool_choice) or self.response_format

    def features(self) -> frozenset[str]:
        """The request's features that not every generator honours (keys of :data:`NOT_YET_SERVED`)."""
        sampling = self.sampling
        used = {"logprobs": self.logprobs is not None, "response_format": self.response_format is not None,
                "forced_tool_call": self.tool_choice.forced, "frequency_penalty": sampling.frequency_penalty != 0.0,
                "presence_penalty": sampling.presence_penalty != 0.0,
                "repetition_penalty": sampling.repetition_penalty != 1.0, "logit_bias": bool(sampling.logit_bias)}
        return frozenset(k for k, on in used.items() if on)


_bad = bad_request


def _get(body: Mapping[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise _bad(f"'{name}' must be {what}, got {json.dumps(value)[:60]}", name)
    return value


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = _get(body, name, (int, float), "a number")
    if value is not None and not (low <= value <= high and math.isfinite(value)):
        raise _bad(f"'{name}' must be between {low} and {high}, got {value}", name)
    return value


def _integer(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = _get(body, name, (int,), "an integer")
    if value is not None and not low <= value <= high:
        raise _bad(f"'{name}' must be between {low} and {high}, got {value}", name)
    return value


def _unicode(text: str, where: str, param: str) -> str:
    """``text``, if the tokenizer can take it: JSON may carry a lone surrogate (``"\\ud800"``), UTF-8 cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(f"{where} is not valid Unicode (a lone surrogate at character {exc.start}); send UTF-8 text",
                   param) from None
    return text


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return _unicode(content, f"messages[{index}].content", "messages")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                           "are supported by this server", "messages")
            parts.append(_unicode(part["text"], f"messages[{index}].content", "messages"))
        return "\n".join(parts)
    raise _bad(f"messages[{index}].content must be a string or a list of text parts", "messages")


def _earlier_calls(raw: Any, index: int) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls``, sent back in the history."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(raw, list) or not raw:
        raise _bad(f"{where} must be a non-empty list of {{id, type: 'function', function: {{name, arguments}}}}",
                   "messages")
    calls = []
    for j, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and call.get("type", "function") == "function"
                and isinstance(call.get("id"), str) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str)):
            raise _bad(f"{where}[{j}] must be {{id: str, type: 'function', function: {{name: str, arguments: "
                       "str (JSON)}}}}", "messages")
        arguments = _unicode(function["arguments"], where, "messages")
        try:
            json.loads(arguments)
        except RecursionError:
            raise _bad(f"{where}[{j}].function.arguments nests too deeply to read; send the call's arguments as "
                       "the model wrote them", "messages") from None
        except ValueError:
            pass  # not JSON: a model's malformed call goes back as its text
        calls.append(ToolCall(_unicode(call["id"], where, "messages"), _unicode(function["name"], where, "messages"),
                              arguments))
    return tuple(calls)


def _message(message: Any, i: int) -> dict[str, Any]:
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ROLES:
        raise _bad(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}", "messages")
    if role == "assistant" and message.get("tool_calls") is not None:
        content = message.get("content")
        return {"role": "assistant", "content": "" if content is None else _message_text(content, i),
                "tool_calls": _earlier_calls(message["tool_calls"], i)}
    out = {"role": ROLES[role], "content": _message_text(message.get("content"), i)}
    if role == "assistant" and message.get("reasoning_content") is not None:
        # an earlier answer's thinking, for the templates that read it back (Qwen3's drops it)
        reasoning = message["reasoning_content"]
        if not isinstance(reasoning, str):
            raise _bad(f"messages[{i}].reasoning_content must be a string", "messages")
        out["reasoning_content"] = _unicode(reasoning, f"messages[{i}].reasoning_content", "messages")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise _bad(f"messages[{i}]: a 'tool' message needs the 'tool_call_id' of the call it answers",
                       "messages")
        out["tool_call_id"] = _unicode(call_id, f"messages[{i}].tool_call_id", "messages")
    return out


def _messages(raw: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    return tuple(_message(message, i) for i, message in enumerate(raw))


def _name(value: Any, where: str, param: str) -> str:
    if not (isinstance(value, str) and 0 < len(value) <= 64 and set(value) <= NAME_CHARS):
        raise _bad(f"{where} must be 1 to 64 letters, digits, '_' or '-', got {json.dumps(value)[:60]}", param)
    return value


def _schema(value: Any, where: str, param: str) -> str:
    """A JSON Schema object as compact JSON text (whether the grammar can compile it is checked there)."""
    if not isinstance(value, dict):
        raise _bad(f"{where} must be a JSON Schema object, got {json.dumps(value)[:60]}", param)
    try:
        return compact_json(value)
    except (ValueError, TypeError, RecursionError) as exc:
        raise _bad(f"{where} cannot be read as JSON ({exc})", param) from None


def _tools(raw: Any) -> tuple[FunctionTool, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise _bad(f"'tools' must be a list of at most {MAX_TOOLS} {{type: 'function', function: {{name, "
                   "description?, parameters?}}}} objects", "tools")
    tools = []
    for i, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise _bad(f"tools[{i}] must be {{type: 'function', function: {{name, description?, parameters?}}}}",
                       "tools")
        description = _get(function, "description", (str,), "a string") or ""
        parameters = function.get("parameters")
        tools.append(FunctionTool(
            name=_name(function.get("name"), f"tools[{i}].function.name", "tools"),
            description=_unicode(description, f"tools[{i}].function.description", "tools"),
            parameters=(_schema(parameters, f"tools[{i}].function.parameters", "tools") if parameters is not None
                        else EMPTY_PARAMETERS),
            strict=bool(_get(function, "strict", (bool,), "true or false"))))
    names = [t.name for t in tools]
    if len(set(names)) < len(names):
        raise _bad(f"'tools' names a function twice: {sorted({n for n in names if names.count(n) > 1})}", "tools")
    return tuple(tools)


def _tool_choice(raw: Any, tools: Sequence[FunctionTool]) -> ToolChoice:
    if raw is None:
        return ToolChoice()
    if isinstance(raw, str) and raw in ("auto", "none", "required"):
        choice = ToolChoice(ToolMode(raw))
    elif isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict):
        name = _name(raw["function"].get("name"), "tool_choice.function.name", "tool_choice")
        if name not in {t.name for t in tools}:
            raise _bad(f"tool_choice names the function {name!r}, which is not in 'tools'", "tool_choice")
        choice = ToolChoice(ToolMode.FUNCTION, name)
    else:
        raise _bad("'tool_choice' must be 'auto', 'none', 'required' or {type: 'function', function: {name}}",
                   "tool_choice")
    if choice.forced and not tools:
        raise _bad(f"tool_choice {raw if isinstance(raw, str) else 'function'!r} needs 'tools'", "tool_choice")
    return choice


def _response_format(raw: Any) -> JsonConstraint | None:
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonConstraint()
    if kind == "json_schema":
        spec = raw.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad("response_format.json_schema must be {name, schema, strict?, description?}", "response_format")
        schema = spec.get("schema")
        return JsonConstraint(
            schema=_schema(schema, "response_format.json_schema.schema", "response_format") if schema is not None
            else None,
            name=_name(spec.get("name"), "response_format.json_schema.name", "response_format"),
            strict=bool(_get(spec, "strict", (bool,), "true or false")))
    raise _bad("'response_format' must be {type: 'text'}, {type: 'json_object'} or {type: 'json_schema', "
               "json_schema: {name, schema}}", "response_format")


def _logprobs(body: Mapping[str, Any], kind: str) -> int | None:
    """chat: ``logprobs`` true (+ ``top_logprobs`` k); completions: ``logprobs`` k. None: not asked."""
    if kind == "text":
        if body.get("top_logprobs") is not None:
            raise _bad("'top_logprobs' is a chat field; /v1/completions takes 'logprobs': <count>", "top_logprobs")
        return _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if not _get(body, "logprobs", (bool,), "true or false"):
        if top is not None:
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def _reasoning_effort(raw: Any, kind: str) -> ReasoningEffort | None:
    if raw is None:
        return None
    if kind == "text":
        raise _bad("'reasoning_effort' is a chat field; send it to /v1/chat/completions", "reasoning_effort")
    try:
        return ReasoningEffort(raw)
    except ValueError:
        raise _bad(f"'reasoning_effort' must be one of {[e.value for e in ReasoningEffort]}, got "
                   f"{json.dumps(raw)[:40]}", "reasoning_effort") from None


def _prompt(raw: Any) -> str | tuple[int, ...]:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]  # a batch of one prompt
    if isinstance(raw, str) and raw:
        return _unicode(raw, "'prompt'", "prompt")
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        if not all(0 <= t <= MAX_TOKEN_ID for t in raw):
            raise _bad(f"'prompt' token ids must be between 0 and {MAX_TOKEN_ID} (and in the model's vocabulary)",
                       "prompt")
        return tuple(raw)
    raise _bad("'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def _stop(raw: Any) -> tuple[str, ...]:
    stops = [raw] if isinstance(raw, str) else raw if raw is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and s for s in stops):
        raise _bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them", "stop")
    return tuple(stops)


def _sampling(body: Mapping[str, Any]) -> SamplingParams:
    """temperature, top_p, top_k, min_p, seed, the penalties and logit_bias (the fields a chat
    front-end's sampler settings send; llama.cpp's ``repeat_penalty`` read as ``repetition_penalty``)."""
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    top_k = _integer(body, "top_k", -1, 1 << 30)  # -1 (vLLM's) and 0 (llama.cpp's, HF's) are off
    repetition = _number(body, "repetition_penalty", 0.0, REPETITION_PENALTY_MAX)
    alias = _number(body, "repeat_penalty", 0.0, REPETITION_PENALTY_MAX)
    if repetition is not None and alias is not None and repetition != alias:
        raise _bad(f"'repetition_penalty' ({repetition}) and its alias 'repeat_penalty' ({alias}) differ; send one",
                   "repetition_penalty")
    repetition = repetition if repetition is not None else alias
    if repetition is not None and repetition <= 0.0:
        raise _bad(f"'repetition_penalty' must be above 0 and at most {REPETITION_PENALTY_MAX} (1 is off, above "
                   f"1 discourages repeating), got {repetition}", "repetition_penalty")
    return SamplingParams(
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        top_k=max(0, top_k or 0),
        seed=_integer(body, "seed", 0, (1 << 63) - 1),
        min_p=float(_number(body, "min_p", 0.0, 1.0) or 0.0),
        frequency_penalty=float(_number(body, "frequency_penalty", -PENALTY_LIMIT, PENALTY_LIMIT) or 0.0),
        presence_penalty=float(_number(body, "presence_penalty", -PENALTY_LIMIT, PENALTY_LIMIT) or 0.0),
        repetition_penalty=1.0 if repetition is None else float(repetition),
        logit_bias=_logit_bias(body.get("logit_bias")),
    )


def _logit_bias(raw: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"<token id>": bias}`` (or llama.cpp's ``[[id, bias], ...]``) as (id, bias) pairs,
    ids ascending; a bias of 0 is left out (it changes nothing). Whether the ids are in the model's
    vocabulary is the generate stage's check (:func:`engine.api.generate.check_logit_bias`)."""
    if raw is None:
        return ()
    what = (f"'logit_bias' must map at most {MAX_LOGIT_BIAS} token ids (as strings: {{\"50256\": -100}}) to "
            f"biases between -{LOGIT_BIAS_LIMIT:g} and {LOGIT_BIAS_LIMIT:g}")
    if isinstance(raw, dict):
        items = list(raw.items())
    elif isinstance(raw, list) and all(isinstance(p, list) and len(p) == 2 for p in raw):
        items = [(str(k) if isinstance(k, int) and not isinstance(k, bool) else k, v) for k, v in raw]
    else:
        raise _bad(f"{what}, got {json.dumps(raw)[:60]}", "logit_bias")
    if len(items) > MAX_LOGIT_BIAS:
        raise _bad(f"{what}; got {len(items)} entries", "logit_bias")
    bias: dict[int, float] = {}
    for key, value in items:
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) <= MAX_TOKEN_ID):
            raise _bad(f"{what}; {json.dumps(key)[:40]} is not a token id", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT):
            raise _bad(f"{what}; token {key} has {json.dumps(value)[:40]}", "logit_bias")
        if int(key) in bias:
            raise _bad(f"{what}; token {int(key)} is named twice", "logit_bias")
        bias[int(key)] = float(value)
    return tuple(sorted((t, b) for t, b in bias.items() if b != 0.0))


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body, which must be a JSON object; :class:`ApiError` 400 otherwise."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise _bad(f"the request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    return body


def parse_completion(body: Mapping[str, Any], kind: str, served: str | Collection[str] | None = None, *,
                     pending: Collection[str] = frozenset(NOT_YET_SERVED),
                     max_prompt_tokens: int | None = None) -> CompletionParams:
    """Validate a decoded /v1/chat/completions (``kind`` "chat") or /v1/completions ("text") body.

    Raises :class:`ApiError` 400 for an invalid field or a feature in ``pending`` (the generators
    do not honour it yet; see :data:`NOT_YET_SERVED`), and 404 for a model not among ``served``
    (a name or several; None: the caller resolves the model, as the server does through its router).
    With ``max_prompt_tokens``, a prompt too long to be worth tokenising is a 400 too
    (:func:`check_prompt_chars`).
    """
    model = _get(body, "model", (str,), "a model name (see /v1/models)")
    names = (served,) if isinstance(served, str) else tuple(served) if served is not None else None
    if model is not None and names is not None and model not in names:
        raise model_not_found(model, names)
    for name in UNSUPPORTED:
        if body.get(name):
            raise _bad(f"'{name}' is not supported by this server; leave it out", name)
    n = _integer(body, "n", 1, MAX_CHOICES) or 1
    if _integer(body, "best_of", 1, 1 << 30) not in (None, 1):
        raise _bad("'best_of' must be 1 on this server", "best_of")
    max_tokens = _integer(body, "max_completion_tokens", 1, 1 << 30)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, 1 << 30)
    try:
        sampling = _sampling(body)
    except GenerationError as exc:
        raise _bad(str(exc)) from exc
    stream = bool(_get(body, "stream", (bool,), "true or false"))
    options = _get(body, "stream_options", (dict,), "an object") or {}
    tools = _tools(body.get("tools")) if kind == "chat" else ()
    if kind == "text":
        for name in ("tools", "tool_choice", "response_format"):
            if body.get(name) is not None:
                raise _bad(f"'{name}' is a chat field; send it to /v1/chat/completions", name)
    params = CompletionParams(
        kind=kind,
        model=model,
        messages=_messages(body.get("messages")) if kind == "chat" else (),
        prompt=_prompt(body.get("prompt")) if kind == "text" else "",
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=stream and bool(_get(options, "include_usage", (bool,), "true or false")),
        n=n,
        logprobs=_logprobs(body, kind),
        response_format=_response_format(body.get("response_format")) if kind == "chat" else None,
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools) if kind == "chat" else ToolChoice(),
        reasoning_effort=_reasoning_effort(body.get("reasoning_effort"), kind),
    )
    for feature in sorted(params.features() & set(pending)):
        param, why = NOT_YET_SERVED[feature]
        raise _bad(f"'{param}': {why}", param)
    if max_prompt_tokens is not None:
        check_prompt_chars(params, max_prompt_tokens)
    return params


def requested_model(body: Mapping[str, Any]) -> str | None:
    """The model a decoded body names (cut to 100 characters), valid or not: what the audit records."""
    model = body.get("model")
    return model[:100] if isinstance(model, str) else None


# -- the prompt's size, before any tokenising ------------------------------------------------------

def prompt_chars(params: CompletionParams) -> int:
    """The characters the template would render, counted before any tokenising: every chat
    message's content (text parts joined), an assistant's earlier calls (id, name, arguments) and
    reasoning (``reasoning_content``), a tool message's call id, and every declared tool (name,
    description, parameters: counted even under ``tool_choice: none``, when they are not shown);
    or the prompt (a prompt of token ids counts one per id)."""
    if params.kind != "chat":
        return len(params.prompt)
    n = 0
    for m in params.messages:
        n += len(m.get("content", "")) + len(m.get("tool_call_id", "")) + len(m.get("reasoning_content", ""))
        n += sum(len(c.id) + len(c.name) + len(c.arguments) for c in m.get("tool_calls", ()))
    return n + sum(len(t.name) + len(t.description) + len(t.parameters) for t in params.tools)


def check_prompt_chars(params: CompletionParams, max_prompt_tokens: int) -> None:
    """Raise ApiError 400 ``context_length_exceeded`` for a prompt too long to be worth tokenising:
    rendering and tokenising cost time in proportion to the text, and no tokenizer produces fewer
    than one token per :data:`CHARS_PER_TOKEN` characters of natural text in practice (English
    averages about 4)."""
    n, limit = prompt_chars(params), CHARS_PER_TOKEN * max_prompt_tokens
    if n > limit:
        raise ApiError(400, f"the prompt has {n} characters (messages, earlier tool calls and tools counted); this "
                       f"server accepts at most {max_prompt_tokens} tokens, so at most {limit} characters are read. "
                       "Shorten the prompt, the conversation or the tools.", "context_length_exceeded",
                       param="messages" if params.kind == "chat" else "prompt")
