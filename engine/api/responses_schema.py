"""Stage 1 of a /v1/responses request, parse: the Responses body in, a :class:`ResponseParams` out.

A Responses request is a chat request in another shape, so it is translated into the chat body it
means and validated by :func:`~engine.api.openai_schema.parse_completion` (one set of rules, one set
of limits): ``instructions`` become the first (system) message, then the conversation of
``previous_response_id`` (its input and its output, not its instructions, as OpenAI chains them),
then ``input`` — a string (one user message) or items: messages (``input_text``/``output_text``
parts), ``function_call`` items (an assistant's calls) and ``function_call_output`` items (a tool
message each). Function tools (``{type: "function", name, description, parameters, strict}``),
``tool_choice`` (``{type: "function", name}`` too), ``text.format`` (``text``, ``json_object``,
``json_schema``: the same grammar as ``response_format``), ``max_output_tokens``, ``temperature``,
``top_p`` and ``reasoning.effort`` map to their chat fields; chat's penalties and samplers
(``frequency_penalty`` … ``logit_bias``, ``seed``) pass through as they are. Every other tool type and input part
(images, files, web search …) is refused by name, as are the features this server does not run
(``background``, stored prompts, conversations). Errors name the Responses field, not the chat one.

Pure: no I/O; the stored previous response is looked up by the route and passed in.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.api.api_error import ApiError, bad_request
from engine.api.openai_schema import NOT_YET_SERVED, CompletionParams, parse_completion

MAX_ITEMS = 1024  # input items in one request
MAX_METADATA = 16  # keys, as OpenAI: keys <= 64 characters, values <= 512
REFUSED_FIELDS = {
    "background": "background responses are not run by this server; send the request and wait for it",
    "prompt": "stored prompt templates are not kept by this server; send 'instructions' and 'input'",
    "conversation": "conversations are not kept by this server; chain responses with 'previous_response_id'",
    "top_logprobs": "log-probabilities are served by /v1/chat/completions ('logprobs'), not here",
}
# chat's sampling fields beyond OpenAI's Responses (llama.cpp, vLLM and Open WebUI send them): passed on as they are
SAMPLER_EXTRAS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "repeat_penalty", "top_k", "min_p",
                  "logit_bias", "seed")
# Responses field -> the chat field its errors come back under (renamed for the caller)
CHAT_PARAM = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
              "messages": "input", "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


@dataclass(frozen=True)
class ResponseParams:
    """A validated Responses request: the chat request it means and what only a Responses answer
    carries (echoed back: ``instructions``, ``tools`` and ``text`` as given, ``metadata``)."""

    chat: CompletionParams
    conversation: tuple[dict[str, Any], ...]  # the chat messages after instructions (what a follow-up chains)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: Mapping[str, str] = field(default_factory=dict)
    tools: tuple[dict[str, Any], ...] = ()  # as given, for the echo
    tool_choice: Any = "auto"
    text_format: Mapping[str, Any] = field(default_factory=lambda: {"type": "text"})
    max_output_tokens: int | None = None


def parse_response_request(body: Mapping[str, Any], served: str | Collection[str] | None = None, *,
                           previous: Sequence[dict[str, Any]] = (),
                           pending: Collection[str] = frozenset(NOT_YET_SERVED),
                           max_prompt_tokens: int | None = None) -> ResponseParams:
    """Validate a decoded /v1/responses body; ``previous`` is the conversation of the response named by
    ``previous_response_id`` (the route looked it up; empty when none). ApiError 400/404 as chat's."""
    for name, why in REFUSED_FIELDS.items():
        if body.get(name):
            raise bad_request(f"'{name}': {why}", name)
    if body.get("n") not in (None, 1):
        raise bad_request("'n' is not a Responses field; a response has one output", "n")
    instructions = _optional_str(body, "instructions")
    conversation = [*previous, *_input_messages(body.get("input"))]
    tools = _tools(body.get("tools"))
    text_format = _text_format(body.get("text"))
    chat_body: dict[str, Any] = {
        "messages": ([{"role": "system", "content": instructions}] if instructions else []) + conversation,
        "stream": body.get("stream", False),
    }
    for name in ("model", "temperature", "top_p", *SAMPLER_EXTRAS):
        if body.get(name) is not None:
            chat_body[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat_body["max_tokens"] = body["max_output_tokens"]
    if tools:
        chat_body["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                                  "strict") if k in t}}
                              for t in tools]
    if body.get("tool_choice") is not None:
        chat_body["tool_choice"] = _tool_choice(body["tool_choice"])
    if text_format.get("type") != "text":
        chat_body["response_format"] = _response_format(text_format)
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise bad_request("'reasoning' must be an object such as {effort: 'low'}", "reasoning")
        if reasoning.get("effort") is not None:
            chat_body["reasoning_effort"] = reasoning["effort"]
    try:
        chat = parse_completion(chat_body, "chat", served, pending=pending, max_prompt_tokens=max_prompt_tokens)
    except ApiError as exc:
        if exc.param in CHAT_PARAM:
            raise ApiError(exc.status, _renamed(exc.message, exc.param), exc.code, param=CHAT_PARAM[exc.param],
                           headers=exc.headers) from None
        raise
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise bad_request("'store' must be true or false", "store")
    previous_id = _optional_str(body, "previous_response_id")
    return ResponseParams(chat=chat, conversation=tuple(conversation), instructions=instructions,
                          previous_response_id=previous_id, store=store, metadata=_metadata(body.get("metadata")),
                          tools=tuple(tools), tool_choice=body.get("tool_choice") or "auto", text_format=text_format,
                          max_output_tokens=chat.max_tokens)


def _renamed(message: str, chat_param: str) -> str:
    return message.replace(f"'{chat_param}'", f"'{CHAT_PARAM[chat_param]}'")


def _optional_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string", name)
    return value


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (``input_text``/``output_text``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of input_text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{where}.content[{j}] is {kind}: this server's models read text only", "input")
        else:
            raise bad_request(f"{where}.content[{j}] must be {{type: 'input_text', text}}", "input")
    return "".join(texts)


def _input_messages(raw: Any) -> list[dict[str, Any]]:
    """The chat messages ``input`` means (see the module docstring)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw or len(raw) > MAX_ITEMS:
        raise bad_request(f"'input' must be a string or a list of 1 to {MAX_ITEMS} items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object (a message, function_call or function_call_output)",
                              "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"input[{i}].role must be user, system, developer or assistant", "input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # consecutive calls are one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text(output, f"input[{i}].output")})
        elif kind == "reasoning":
            continue  # a model's earlier reasoning is not shown to it again (as chat templates drop it)
        else:
            raise bad_request(f"input[{i}] is of type {kind!r}; this server reads message, function_call, "
                              "function_call_output and reasoning items", "input")
    return messages


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list of {type: 'function', name, parameters} objects", "tools")
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}] is of type {kind!r}: this server runs function tools only (no built-in "
                              "web search, file search, code interpreter, computer use, MCP or image tools)", "tools")
    return list(raw)


def _tool_choice(raw: Any) -> Any:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function":
        return {"type": "function", "function": {"name": raw.get("name")}}
    raise bad_request("'tool_choice' must be 'auto', 'none', 'required' or {type: 'function', name}", "tool_choice")


def _text_format(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {"type": "text"}
    fmt = raw.get("format") if isinstance(raw, dict) else None
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("'text.format' must be {type: 'text'}, {type: 'json_object'} or {type: 'json_schema', "
                          "name, schema}", "text.format")
    return dict(fmt)


def _response_format(fmt: Mapping[str, Any]) -> dict[str, Any]:
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _metadata(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if (not isinstance(raw, dict) or len(raw) > MAX_METADATA
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                       for k, v in raw.items())):
        raise bad_request(f"'metadata' must be an object of at most {MAX_METADATA} string keys (<= 64 characters) "
                          "and string values (<= 512)", "metadata")
    return dict(raw)


def output_conversation(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat message(s) a response's output adds to its conversation (for a follow-up)."""
    out = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [json.loads(json.dumps(c)) for c in message["tool_calls"]]
    return [out]
