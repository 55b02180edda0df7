"""The coordinator's OpenAI-compatible HTTP API (aiohttp, one asyncio loop).

Routes: ``/v1/chat/completions`` and ``/v1/completions`` (JSON or SSE streaming),
``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text). Text is this layer's business:
requests are parsed and tokenized here into a :class:`GenerationRequest` of ids, and the
:class:`Generator`'s token ids are turned back into text deltas here, stop strings included.

The pure parts (:func:`parse_completion`, :func:`to_generation_request`, :class:`TextStream`,
:func:`api_error_from`, :class:`ApiMetrics`, :func:`render_prometheus`) hold the policy; the
handlers only move bytes. A client that disconnects cancels its handler (aiohttp
``handler_cancellation``), and closing the token stream cancels the generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from engine.errors import DeskfleetError, GenerationError, TokenizerError
from engine.generator import Generator, ModelCard, OverloadedError, UnavailableError
from engine.request import FinishReason, GenerationRequest, SamplingParams
from engine.tokenizer import ChatTokenizer

log = logging.getLogger("deskfleet.api")

STAGES_HEADER = "X-Deskfleet-Stages"
PUBLIC_PATHS = frozenset({"/health"})  # reachable without the bearer token (liveness probes)
MAX_STOP_STRINGS = 4
CLIENT_CLOSED = 499  # nginx's code for "client closed the request", used in the request counter
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
# Fields a client may send that this server cannot honour: refuse them rather than ignore them.
UNSUPPORTED = ("tools", "functions", "logprobs", "top_logprobs", "logit_bias", "echo", "suffix",
               "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class ApiSettings:
    """Limits and identity of the API, parsed once (``api_key`` None means no auth)."""

    model_name: str | None = None  # None: the generator's model name
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 4096
    default_max_tokens: int = 256
    max_tokens_limit: int = 2048
    max_concurrent: int = 16
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_tokens", "default_max_tokens", "max_tokens_limit",
                     "max_concurrent", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"ApiSettings.{name} must be at least 1, got {getattr(self, name)}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("ApiSettings.default_max_tokens must not exceed max_tokens_limit")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ApiSettings.api_key is empty; pass None to disable auth")


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
        return ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
# Engine exceptions -> (status, code); the first matching class wins.
EXCEPTION_STATUS: tuple[tuple[type[Exception], int, str], ...] = (
    (OverloadedError, 429, "overloaded"),
    (UnavailableError, 503, "unavailable"),
    (GenerationError, 400, "invalid_request"),
    (TokenizerError, 400, "invalid_prompt"),
)
INTERNAL_MESSAGE = "internal server error; the server log has the details"
NO_SUCH_PATH = "no such path; the API serves /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics"


def api_error_from(exc: BaseException) -> ApiError:
    """The HTTP answer for an exception raised while handling a request."""
    if isinstance(exc, ApiError):
        return exc
    for cls, status, code in EXCEPTION_STATUS:
        if isinstance(exc, cls):
            return ApiError(status, str(exc), code)
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = " or ".join(sorted(exc.allowed_methods))
        return ApiError(405, f"{exc.method} is not allowed on this path; use {allowed}", "method_not_allowed")
    if isinstance(exc, web.HTTPException):
        return ApiError(exc.status, NO_SUCH_PATH if exc.status == 404 else exc.reason,
                        exc.reason.lower().replace(" ", "_"))
    return ApiError(500, INTERNAL_MESSAGE, "internal_error")


# -- request parsing (pure) --------------------------------------------------------------------

@dataclass(frozen=True)
class CompletionParams:
    """A validated chat or completions request; ``prompt`` is text or token ids for "text"."""

    kind: str  # "chat" or "text"
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


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                           "are supported by this server", "messages")
            parts.append(part["text"])
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
        return raw
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw):
        return tuple(raw)
    raise _bad("'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def _stop(raw: Any) -> tuple[str, ...]:
    stops = [raw] if isinstance(raw, str) else raw if raw is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and s for s in stops):
        raise _bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them", "stop")
    return tuple(stops)


def parse_completion(body: Mapping[str, Any], kind: str, served_model: str) -> CompletionParams:
    """Validate a decoded /v1/chat/completions (``kind`` "chat") or /v1/completions ("text") body.

    Raises :class:`ApiError` 400 for an invalid field and 404 for a model this server does not serve.
    """
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"model {model!r} is not served here; use {served_model!r} (see /v1/models)",
                       "model_not_found", param="model")
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
        messages=_messages(body.get("messages")) if kind == "chat" else (),
        prompt=_prompt(body.get("prompt")) if kind == "text" else "",
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=stream and bool(_get(options, "include_usage", (bool,), "true or false")),
    )


def to_generation_request(prompt_ids: Sequence[int], params: CompletionParams, settings: ApiSettings,
                          card: ModelCard) -> GenerationRequest:
    """The id-level request for a tokenized prompt, within the server's limits and the model's context."""
    n = len(prompt_ids)
    if n > settings.max_prompt_tokens or n >= card.context_length:
        limit = min(settings.max_prompt_tokens, card.context_length - 1)
        raise ApiError(400, f"the prompt has {n} tokens; this server accepts at most {limit}. "
                       "Shorten the prompt or the conversation.", "context_length_exceeded", param="messages")
    room = card.context_length - n
    if params.max_tokens is None:
        max_new = min(settings.default_max_tokens, room)
    elif params.max_tokens > settings.max_tokens_limit:
        raise _bad(f"max_tokens is {params.max_tokens}; this server allows at most "
                   f"{settings.max_tokens_limit}", "max_tokens")
    elif params.max_tokens > room:
        raise ApiError(400, f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceed the model's "
                       f"context of {card.context_length}; ask for at most {room} tokens",
                       "context_length_exceeded", param="max_tokens")
    else:
        max_new = params.max_tokens
    return GenerationRequest(prompt_ids=tuple(prompt_ids), max_new_tokens=max_new, sampling=params.sampling,
                             stop_token_ids=card.eos_token_ids)


# -- incremental detokenization (pure) ---------------------------------------------------------

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


# -- metrics (pure) ----------------------------------------------------------------------------

@dataclass
class ApiMetrics:
    """The API's own counters, rendered next to the generator's on /metrics."""

    requests: dict[int, int] = field(default_factory=dict)  # by HTTP status
    active: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    generation_seconds: float = 0.0  # first token to last, summed over requests
    last_decode_tok_per_s: float = 0.0
    ttft_counts: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    ttft_sum: float = 0.0

    def count(self, status: int) -> None:
        self.requests[status] = self.requests.get(status, 0) + 1

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_counts[next((i for i, b in enumerate(TTFT_BUCKETS) if seconds <= b), len(TTFT_BUCKETS))] += 1
        self.ttft_sum += seconds

    def observe_generation(self, tokens: int, decode_seconds: float) -> None:
        self.completion_tokens += tokens
        self.generation_seconds += decode_seconds
        if tokens > 1 and decode_seconds > 0:
            self.last_decode_tok_per_s = (tokens - 1) / decode_seconds


# ApiMetrics attribute -> (metric name, type, help)
API_SCALARS = {
    "active": ("api_active_requests", "gauge", "generation requests in flight"),
    "prompt_tokens": ("api_prompt_tokens_total", "counter", "prompt tokens admitted"),
    "completion_tokens": ("api_completion_tokens_total", "counter", "tokens generated"),
    "generation_seconds": ("api_generation_seconds_total", "counter", "first to last token, summed over requests"),
    "last_decode_tok_per_s": ("api_decode_tokens_per_second", "gauge", "decode speed of the last request"),
}
_METRIC_KEY = re.compile(r"^([^{]*)(\{.*\})?$")


def _value(v: float) -> str:
    if math.isnan(v) or math.isinf(v):
        return "NaN" if math.isnan(v) else "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if float(v).is_integer() and abs(v) < 1 << 53 else repr(float(v))


def _family(lines: list[str], name: str, kind: str, help_text: str, samples: Sequence[tuple[str, float]]) -> None:
    """One metric family; a sample's "labels" may start with a suffix (``_bucket{le="1"}``)."""
    lines += [f"# HELP deskfleet_{name} {help_text}", f"# TYPE deskfleet_{name} {kind}"]
    lines += [f"deskfleet_{name}{labels} {_value(v)}" for labels, v in samples]


def render_prometheus(generator_metrics: Mapping[str, float], api: ApiMetrics) -> str:
    """Prometheus text exposition (0.0.4) of the generator's metrics and the API's, prefixed ``deskfleet_``.

    A generator key may carry labels (``stage_seconds_total{stage="1"}``); names ending in
    ``_total`` are counters, everything else a gauge.
    """
    lines: list[str] = []
    grouped: dict[str, list[tuple[str, float]]] = {}
    for key, v in sorted(generator_metrics.items()):
        base, labels = _METRIC_KEY.match(key).groups()  # type: ignore[union-attr]
        grouped.setdefault(re.sub(r"[^a-zA-Z0-9_:]", "_", base), []).append((labels or "", float(v)))
    for name, samples in grouped.items():
        _family(lines, name, "counter" if name.endswith("_total") else "gauge", "reported by the generator", samples)
    _family(lines, "api_requests_total", "counter", "HTTP requests answered, by status code",
            [(f'{{code="{code}"}}', n) for code, n in sorted(api.requests.items())])
    for attr, (name, kind, help_text) in API_SCALARS.items():
        _family(lines, name, kind, help_text, [("", getattr(api, attr))])
    bounds = (*map(str, TTFT_BUCKETS), "+Inf")
    cumulative = [sum(api.ttft_counts[: i + 1]) for i in range(len(bounds))]
    _family(lines, "api_ttft_seconds", "histogram", "time to first token",
            [*((f'_bucket{{le="{b}"}}', n) for b, n in zip(bounds, cumulative, strict=True)),
             ("_sum", api.ttft_sum), ("_count", cumulative[-1])])
    return "\n".join(lines) + "\n"


# -- HTTP --------------------------------------------------------------------------------------

@dataclass
class _Outcome:
    finish_reason: str = "stop"
    completion_tokens: int = 0


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
_GONE = web.RequestKey("client_gone", bool)


def _sse(payload: Mapping[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Api:
    def __init__(self, generator: Generator, tokenizer: ChatTokenizer, settings: ApiSettings):
        self.generator = generator
        self.tokenizer = tokenizer
        self.settings = settings
        self.metrics = ApiMetrics()
        self.served_model = settings.model_name or generator.model.name
        self._key = settings.api_key.encode() if settings.api_key else None

    @web.middleware
    async def errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            self._authorize(request)
            response = await handler(request)
        except asyncio.CancelledError:
            self.metrics.count(CLIENT_CLOSED)
            raise
        except Exception as exc:
            error = api_error_from(exc)
            if error.status == 500:
                log.exception("unhandled error on %s %s", request.method, request.path)
            headers = error.headers
            if error.status in (429, 503):
                headers = {"Retry-After": str(self.settings.retry_after_s), **headers}
            response = web.json_response(error.body(), status=error.status, headers=headers)
        self.metrics.count(CLIENT_CLOSED if request.get(_GONE) else response.status)
        return response

    def _authorize(self, request: web.Request) -> None:
        if self._key is None or request.path in PUBLIC_PATHS:
            return
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise ApiError(401, "missing or wrong API key; send 'Authorization: Bearer <key>' with the key "
                           "the server was started with", "invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[STAGES_HEADER] = str(self.generator.model.stages)

    async def health(self, request: web.Request) -> web.Response:
        card = self.generator.model
        return web.json_response({"status": "ok", "model": self.served_model, "stages": card.stages,
                                  "active_requests": self.metrics.active})

    async def prometheus(self, request: web.Request) -> web.Response:
        text = render_prometheus(self.generator.metrics(), self.metrics)
        return web.Response(text=text, content_type="text/plain", headers={"Cache-Control": "no-store"})

    def _model_entry(self) -> dict[str, Any]:
        return {"id": self.served_model, "object": "model", "created": 0, "owned_by": "deskfleet",
                "context_length": self.generator.model.context_length}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_entry()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.served_model:
            raise ApiError(404, f"model {request.match_info['model']!r} is not served here; "
                           f"use {self.served_model!r}", "model_not_found")
        return web.json_response(self._model_entry())

    async def _read_json(self, request: web.Request) -> Mapping[str, Any]:
        too_large = ApiError(413, f"the request body exceeds {self.settings.max_body_bytes} bytes; "
                             "send a shorter prompt", "request_too_large")
        if (request.content_length or 0) > self.settings.max_body_bytes:
            raise too_large
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise _bad(f"the request body is not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        return body

    def _encode(self, params: CompletionParams) -> list[int]:
        if params.kind == "chat":
            return self.tokenizer.encode_chat(params.messages)
        if isinstance(params.prompt, tuple):
            return list(params.prompt)
        return self.tokenizer.encode(params.prompt)

    async def complete(self, kind: str, request: web.Request) -> web.StreamResponse:
        """Answer /v1/chat/completions (``kind`` "chat") or /v1/completions ("text")."""
        started = time.perf_counter()
        params = parse_completion(await self._read_json(request), kind, self.served_model)
        gen_request = to_generation_request(self._encode(params), params, self.settings, self.generator.model)
        if self.metrics.active >= self.settings.max_concurrent:
            raise ApiError(429, f"the server is handling {self.metrics.active} requests, its limit; retry "
                           f"in {self.settings.retry_after_s} s", "too_many_requests")
        self.metrics.active += 1
        self.metrics.prompt_tokens += len(gen_request.prompt_ids)
        outcome = _Outcome()
        deltas = self._deltas(gen_request, params.stop, outcome, started)
        try:
            async with contextlib.aclosing(deltas):
                if params.stream:
                    return await self._send_stream(request, params, gen_request, deltas, outcome)
                text = "".join([piece async for piece in deltas])
        finally:
            self.metrics.active -= 1
        prefix, obj, _, choice = SHAPES[kind]
        return web.json_response({
            "id": prefix + uuid.uuid4().hex, "object": obj, "created": int(time.time()),
            "model": self.served_model, "choices": [choice(text, outcome.finish_reason, False)],
            "usage": self._usage(gen_request, outcome)})

    @staticmethod
    def _usage(gen_request: GenerationRequest, outcome: _Outcome) -> dict[str, int]:
        n = len(gen_request.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": outcome.completion_tokens,
                "total_tokens": n + outcome.completion_tokens}

    async def _deltas(self, gen_request: GenerationRequest, stop: Sequence[str], outcome: _Outcome,
                      started: float) -> AsyncIterator[str]:
        """Yield one text delta (maybe empty) per generated token, then the held-back tail."""
        text = TextStream(self.tokenizer.decode, stop)
        first_at = 0.0
        try:
            # aclosing: leaving this block early (stop string, disconnect, error) cancels the request.
            async with contextlib.aclosing(self.generator.stream(gen_request)) as tokens:
                async for event in tokens:
                    if not outcome.completion_tokens:
                        first_at = time.perf_counter()
                        self.metrics.observe_ttft(first_at - started)
                    outcome.completion_tokens += 1
                    delta = text.push(event.token_id)
                    if text.stopped:
                        outcome.finish_reason = "stop"
                        yield delta
                        return
                    if event.finish is not None:
                        if event.finish not in FINISH_REASONS:
                            raise UnavailableError("the coordinator cancelled this request (it is stopping or "
                                                   "a stage failed); retry it")
                        outcome.finish_reason = FINISH_REASONS[event.finish]
                        yield delta
                        break
                    yield delta
            yield text.finish()
        finally:
            if outcome.completion_tokens:
                self.metrics.observe_generation(outcome.completion_tokens, time.perf_counter() - first_at)

    async def _send_stream(self, request: web.Request, params: CompletionParams, gen_request: GenerationRequest,
                           deltas: AsyncIterator[str], outcome: _Outcome) -> web.StreamResponse:
        # Wait for the first token before sending headers so refusals (429/503) keep their status.
        piece = await anext(deltas, None)
        prefix, _, obj, choice = SHAPES[params.kind]
        head = {"id": prefix + uuid.uuid4().hex, "object": obj, "created": int(time.time()),
                "model": self.served_model}
        extra = {"usage": None} if params.include_usage else {}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        try:
            if params.kind == "chat":
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                await response.write(_sse({**head, "choices": [role], **extra}))
            while piece is not None:
                if piece:
                    await response.write(_sse({**head, "choices": [choice(piece, None, True)], **extra}))
                piece = await anext(deltas, None)
            await response.write(_sse({**head, "choices": [choice("", outcome.finish_reason, True)], **extra}))
            if params.include_usage:
                await response.write(_sse({**head, "choices": [], "usage": self._usage(gen_request, outcome)}))
            await response.write(_sse("[DONE]"))
        except ConnectionResetError:
            request[_GONE] = True
            log.debug("client left during a streamed answer; generation cancelled")
        except Exception as exc:  # after the headers: report in-band, as OpenAI does
            error = api_error_from(exc)
            if error.status == 500:
                log.exception("generation failed mid-stream")
            with contextlib.suppress(ConnectionResetError):
                await response.write(_sse(error.body()))
        return response



def build_app(generator: Generator, tokenizer: ChatTokenizer, settings: ApiSettings) -> web.Application:
    """The aiohttp application serving ``generator`` under the OpenAI API, within ``settings``' limits."""
    api = _Api(generator, tokenizer, settings)
    app = web.Application(middlewares=[api.errors], client_max_size=settings.max_body_bytes)
    app.on_response_prepare.append(api.add_headers)
    app.router.add_post("/v1/chat/completions", functools.partial(api.complete, "chat"))
    app.router.add_post("/v1/completions", functools.partial(api.complete, "text"))
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model}", api.model)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.prometheus)
    return app


@dataclass
class RunningApi:
    """A started API server; ``async_stop()`` closes the listener and ends in-flight requests."""

    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    async def async_stop(self) -> None:
        """Stop listening, give in-flight requests the runner's grace period, then cancel them."""
        await self.runner.cleanup()


async def async_run_api(generator: Generator, tokenizer: ChatTokenizer, settings: ApiSettings,
                        host: str = "127.0.0.1", port: int = 0, *, shutdown_timeout: float = 5.0) -> RunningApi:
    """Serve the API on ``host:port`` (0 picks a free port) in the running loop; return the bound port.

    A client that disconnects cancels its handler, which closes its token stream.
    """
    runner = web.AppRunner(build_app(generator, tokenizer, settings), handler_cancellation=True,
                           shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise DeskfleetError(f"cannot listen on {host}:{port} ({exc}); pick another --port or stop "
                               "the program using it") from exc
    return RunningApi(runner, host, runner.addresses[0][1])
