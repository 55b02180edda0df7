"""The OpenAI wire schema, as pure code: request bodies in, response bodies and SSE chunks out.

:func:`parse_completion` validates a decoded /v1/chat/completions or /v1/completions body into
:class:`CompletionParams`; :func:`to_generation_request` turns it and the tokenized prompt into
an id-level :class:`GenerationRequest` within the server's limits; :class:`TextStream` turns the
generated ids back into text deltas, stop strings included; :func:`completion_response` and
:class:`CompletionChunks` give the answer its OpenAI shape. Invalid input raises
:class:`ApiError`. No sockets and no aiohttp here: :mod:`engine.api.server` moves the bytes.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.errors import DeskfleetError, GenerationError
from engine.generation.generator import ModelCard
from engine.generation.request import FinishReason, GenerationRequest, SamplingParams

MAX_STOP_STRINGS = 4
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
# Fields a client may send that this server cannot honour: refuse them rather than ignore them.
UNSUPPORTED = ("tools", "functions", "logprobs", "top_logprobs", "logit_bias", "echo", "suffix",
               "presence_penalty", "frequency_penalty")
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


class ApiError(DeskfleetError):
    """A request the API answers with an OpenAI-style error body and a 4xx/5xx status."""

    def __init__(self, status: int, message: str, code: str, *, param: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        """OpenAI's error ``type`` for this status."""
        return ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        """The JSON error body: ``{"error": {message, type, param, code}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def model_not_found(model: str, served: Sequence[str]) -> ApiError:
    """The 404 for a request naming a model this server does not serve."""
    listed = ", ".join(repr(m) for m in served) or "none right now"
    return ApiError(404, f"model {model!r} is not served here; served models: {listed} (see /v1/models)",
                    "model_not_found", param="model")


class TokenLimits(Protocol):
    """The server's token limits that :func:`to_generation_request` enforces (``engine.api.server.ApiSettings``)."""

    @property
    def max_prompt_tokens(self) -> int: ...

    @property
    def default_max_tokens(self) -> int: ...

    @property
    def max_tokens_limit(self) -> int: ...


# -- request parsing ---------------------------------------------------------------------------

@dataclass(frozen=True)
class CompletionParams:
    """A validated chat or completions request; ``prompt`` is text or token ids for "text"."""

    kind: str  # "chat" or "text"
    model: str | None = None  # the requested model; None: the server's first (the router resolves it)
    messages: tuple[dict[str, str], ...] = ()
    prompt: str | tuple[int, ...] = ""
    max_tokens: int | None = None  # None: the server default, clipped to the context
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_value" if param else "invalid_request", param=param)


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


def _messages(raw: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(raw):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise _bad(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}", "messages")
        out.append({"role": ROLES[role], "content": _message_text(message.get("content"), i)})
    return tuple(out)


def _prompt(raw: Any) -> str | tuple[int, ...]:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]  # a batch of one prompt
    if isinstance(raw, str) and raw:
        return _unicode(raw, "'prompt'", "prompt")
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw):
        return tuple(raw)
    raise _bad("'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def _stop(raw: Any) -> tuple[str, ...]:
    stops = [raw] if isinstance(raw, str) else raw if raw is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and s for s in stops):
        raise _bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them", "stop")
    return tuple(stops)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body, which must be a JSON object; :class:`ApiError` 400 otherwise."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise _bad(f"the request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    return body


def parse_completion(body: Mapping[str, Any], kind: str,
                     served: str | Collection[str] | None = None) -> CompletionParams:
    """Validate a decoded /v1/chat/completions (``kind`` "chat") or /v1/completions ("text") body.

    Raises :class:`ApiError` 400 for an invalid field, and 404 for a model not among ``served``
    (a name or several; None: the caller resolves the model, as the server does through its router).
    """
    model = _get(body, "model", (str,), "a model name (see /v1/models)")
    names = (served,) if isinstance(served, str) else tuple(served) if served is not None else None
    if model is not None and names is not None and model not in names:
        raise model_not_found(model, names)
    for name in UNSUPPORTED:
        if body.get(name):
            raise _bad(f"'{name}' is not supported by this server; leave it out", name)
    if _integer(body, "n", 1, 1 << 30) not in (None, 1):
        raise _bad("'n' must be 1: this server returns one choice per request", "n")
    if _integer(body, "best_of", 1, 1 << 30) not in (None, 1):
        raise _bad("'best_of' must be 1 on this server", "best_of")
    max_tokens = _integer(body, "max_completion_tokens", 1, 1 << 30)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, 1 << 30)
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    try:
        sampling = SamplingParams(
            temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            top_k=_integer(body, "top_k", 0, 1 << 30) or 0,
            seed=_integer(body, "seed", 0, (1 << 63) - 1),
        )
    except GenerationError as exc:
        raise _bad(str(exc)) from exc
    stream = bool(_get(body, "stream", (bool,), "true or false"))
    options = _get(body, "stream_options", (dict,), "an object") or {}
    return CompletionParams(
        kind=kind,
        model=model,
        messages=_messages(body.get("messages")) if kind == "chat" else (),
        prompt=_prompt(body.get("prompt")) if kind == "text" else "",
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=stream and bool(_get(options, "include_usage", (bool,), "true or false")),
    )


def to_generation_request(prompt_ids: Sequence[int], params: CompletionParams, limits: TokenLimits,
                          card: ModelCard) -> GenerationRequest:
    """The id-level request for a tokenized prompt, within the server's limits and the model's context."""
    n = len(prompt_ids)
    if n > limits.max_prompt_tokens or n >= card.context_length:
        limit = min(limits.max_prompt_tokens, card.context_length - 1)
        raise ApiError(400, f"the prompt has {n} tokens; this server accepts at most {limit}. "
                       "Shorten the prompt or the conversation.", "context_length_exceeded", param="messages")
    room = card.context_length - n
    if params.max_tokens is None:
        max_new = min(limits.default_max_tokens, room)
    elif params.max_tokens > limits.max_tokens_limit:
        raise _bad(f"max_tokens is {params.max_tokens}; this server allows at most "
                   f"{limits.max_tokens_limit}", "max_tokens")
    elif params.max_tokens > room:
        raise ApiError(400, f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceed the model's "
                       f"context of {card.context_length}; ask for at most {room} tokens",
                       "context_length_exceeded", param="max_tokens")
    else:
        max_new = params.max_tokens
    return GenerationRequest(prompt_ids=tuple(prompt_ids), max_new_tokens=max_new, sampling=params.sampling,
                             stop_token_ids=card.eos_token_ids)


# -- incremental detokenization ----------------------------------------------------------------

class TextStream:
    """Turn generated ids into safe-to-send text deltas, and stop at the first stop string.

    Each step decodes the whole generated id list and emits the new suffix, holding back a
    trailing U+FFFD (a multi-byte character cut between tokens) and any tail that could be the
    start of a stop string, so nothing sent ever has to be taken back.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stopped = False  # a stop string was found; the caller should close the token stream

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text that is now safe to send (may be empty)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def finish(self) -> str:
        """Return the held-back text once generation has ended."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.stopped:
            return ""
        full = self._decode(self._ids)
        start = len(self.text)
        hits = [i for i in (full.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        elif final:
            end = len(full)
        else:
            end = start + len(full[start:].rstrip("\ufffd"))
            end -= self._stop_prefix_len(full[start:end])
        delta = full[start:end]
        self.text += delta
        return delta

    def _stop_prefix_len(self, pending: str) -> int:
        longest = max((len(s) for s in self._stop), default=0)
        for k in range(min(len(pending), longest - 1), 0, -1):
            if any(s.startswith(pending[-k:]) for s in self._stop):
                return k
        return 0


# -- response shapes ---------------------------------------------------------------------------

def _chat_choice(text: str, finish: str | None, chunk: bool) -> dict[str, Any]:
    body = {"delta": {"content": text} if text else {}} if chunk else {
        "message": {"role": "assistant", "content": text}}
    return {"index": 0, **body, "finish_reason": finish, "logprobs": None}


def _text_choice(text: str, finish: str | None, chunk: bool) -> dict[str, Any]:
    return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}


# kind -> (id prefix, object, chunk object, choice shape)
SHAPES = {
    "chat": ("chatcmpl-", "chat.completion", "chat.completion.chunk", _chat_choice),
    "text": ("cmpl-", "text_completion", "text_completion", _text_choice),
}


def _head(prefix: str, obj: str, model: str) -> dict[str, Any]:
    return {"id": prefix + uuid.uuid4().hex, "object": obj, "created": int(time.time()), "model": model}


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The ``usage`` object of an answer."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(kind: str, model: str, text: str, finish_reason: str,
                        usage: Mapping[str, int]) -> dict[str, Any]:
    """The whole (non-streamed) answer to a ``kind`` "chat" or "text" request."""
    prefix, obj, _, choice = SHAPES[kind]
    return {**_head(prefix, obj, model), "choices": [choice(text, finish_reason, False)], "usage": dict(usage)}


class CompletionChunks:
    """The chunks of one streamed answer; each repeats the same id, object, created and model.

    With ``include_usage`` every chunk carries ``"usage": null`` and :meth:`usage` gives the last one.
    """

    def __init__(self, kind: str, model: str, include_usage: bool = False):
        prefix, _, obj, self._choice = SHAPES[kind]
        self._kind = kind
        self._head = _head(prefix, obj, model)
        self._extra = {"usage": None} if include_usage else {}

    def opening(self) -> list[dict[str, Any]]:
        """The chunks sent before any text: a chat answer first announces the assistant role."""
        if self._kind != "chat":
            return []
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return [{**self._head, "choices": [role], **self._extra}]

    def delta(self, text: str, finish_reason: str | None = None) -> dict[str, Any]:
        """A chunk of generated text; the last one has empty text and the ``finish_reason``."""
        return {**self._head, "choices": [self._choice(text, finish_reason, True)], **self._extra}

    def usage(self, usage: Mapping[str, int]) -> dict[str, Any]:
        """The closing chunk of an ``include_usage`` stream: no choices, the token counts."""
        return {**self._head, "choices": [], "usage": dict(usage)}


def sse_event(payload: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <compact JSON or the literal string>`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
