"""The coordinator's OpenAI-compatible HTTP API (aiohttp, one asyncio loop).

Routes: ``/v1/chat/completions`` and ``/v1/completions`` (JSON or SSE streaming),
``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text). Every request goes through a
:class:`~engine.generation.router.Router`: the one passed in (many rings, many models, each with
its tokenizer), or one made around a lone generator; the request's ``model`` picks the model,
the router the ring. ``/health`` is the rings' own reports (200 while any can serve, 503 when
none can). Text is this layer's business: prompts are tokenised here and the generated ids
turned back into text, stop strings included.

A completion request is read in one direction, one module a stage, each using only the ones
before it (:meth:`_Api.complete` strings them together; ``tests/architecture`` guards the order):

1. **parse** (:mod:`engine.api.openai_schema`): the body into a frozen :class:`CompletionParams`,
   every field checked (400 naming it, 404 for a model not served), a prompt too long to be worth
   tokenising refused unread;
2. **admit** (:mod:`engine.api.admit`): its streams within the key's share (429);
3. **generate** (:mod:`engine.api.generate`): the prompt rendered and tokenised on a thread (the
   loop keeps stepping the ring), checked against the model's context, and each choice's typed
   token events from the router, charged to the key as they come;
4. **shape** (:mod:`engine.api.openai_answer`): the events into OpenAI's JSON or SSE chunks.

What they share sits below them: :mod:`engine.api.api_error` (the one error), the door, keys and
shares, the metrics. Here only bytes move: :func:`api_error_from` maps errors to answers. A client
that disconnects cancels its handler (aiohttp ``handler_cancellation``), and closing the token
stream cancels the generation.

Before a request costs anything: its ``Host`` must name this server (DNS rebinding), then the key,
then a POST must be ``application/json`` (cross-site forms) (:mod:`engine.api.guard`); then the
key's rate limit and a slot of ``max_concurrent`` (:mod:`engine.api.door`), and the body's size.
Keys are the fleet's key book (named, limited,
revocable: a revoked key is refused on its next request) or one fixed key. Every request of a
key holder but ``/health`` leaves one line in the audit log when one is given
(:mod:`engine.api.audit`: key name, model, ring, status, token counts, duration; never the
text); strangers' refused requests are counted into one summary line a minute.

Off loopback the API is served only over TLS (the fleet CA's service certificate): plain HTTP
on any other address is refused at start (:func:`engine.api.guard.check_exposure`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import logging
import ssl
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from engine.api.admit import Admission
from engine.api.api_error import ApiError, model_not_found
from engine.api.api_metrics import CONTENT_TYPE, ApiMetrics, DictCollector, render
from engine.api.audit import AuditLog, AuditRecord, utc_stamp
from engine.api.door import Door
from engine.api.generate import Generation, Tally, Tokenizers
from engine.api.guard import HostPolicy, check_exposure, check_json_type
from engine.api.keys import ANONYMOUS, Caller, KeyCheck, RateLimiter, retry_after_header
from engine.api.off_loop import off_loop
from engine.api.openai_answer import Answer, sse_event
from engine.api.openai_schema import (
    NOT_YET_SERVED,
    CompletionParams,
    parse_completion,
    parse_json_body,
    requested_model,
)
from engine.api.response_store import ResponseStore
from engine.api.responses_answer import ResponseShape, error_event
from engine.api.responses_schema import output_conversation, parse_response_request
from engine.api.share import StreamShares
from engine.api.usage import WARNING_HEADER, UsageLedger
from engine.errors import DeskfleetError, GenerationError, TokenizerError
from engine.generation.generator import Generator, ModelCard, OverloadedError, UnavailableError
from engine.generation.ring_report import RingStatus, overall_status
from engine.generation.router import Router, UnknownModelError
from engine.http_limits import LimitedAppRunner, LimitedSite
from engine.tasks import start_task
from engine.trust.key_book import KEEP_REVOKED_DAYS, KeyBook, KeyBookError

log = logging.getLogger("deskfleet.api")

STAGES_HEADER = "X-Deskfleet-Stages"
PUBLIC_PATHS = frozenset({"/health"})  # reachable without the bearer token (liveness probes)
CLIENT_CLOSED = 499  # nginx's code for "client closed the request", used in the request counter


@dataclass(frozen=True)
class ApiSettings:
    """Limits and identity of the API, parsed once (``api_key``: one fixed key; None, with no key
    book given to :func:`build_app`, means no auth, which only loopback allows).

    ``allowed_hosts``: host names clients may address the server by, besides the address it is
    bound to and the loopback names (see :mod:`engine.api.guard`).

    ``pending``: request features refused with a 400 naming their field unless the generators
    behind this API honour them (:data:`~engine.api.openai_schema.NOT_YET_SERVED`). A generator
    says which it honours in a ``features`` attribute (the paged coordinator: log-probabilities,
    and constrained output when it knows its model's tokenizer); a feature is served when every
    ring of the router honours it. Tests of a fake generator pass fewer."""

    model_name: str | None = None  # a lone generator's served name; None: its card's (a Router names its own)
    api_key: str | None = field(default=None, repr=False)
    allowed_hosts: tuple[str, ...] = ()
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 4096
    default_max_tokens: int = 256
    max_tokens_limit: int = 2048
    max_concurrent: int = 16
    # streams (choices) one key may have running or queued where keys are required; None: half of
    # max_concurrent (engine.api.share). A server without keys has one user and no share.
    key_streams: int | None = None
    retry_after_s: int = 1
    pending: frozenset[str] = frozenset(NOT_YET_SERVED)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_tokens", "default_max_tokens", "max_tokens_limit",
                     "max_concurrent", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"ApiSettings.{name} must be at least 1, got {getattr(self, name)}")
        if self.key_streams is not None and self.key_streams < 1:
            raise ValueError(f"ApiSettings.key_streams must be at least 1, got {self.key_streams}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("ApiSettings.default_max_tokens must not exceed max_tokens_limit")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ApiSettings.api_key is empty; pass None to disable auth")


# Engine exceptions -> (status, code); the first matching class wins.
EXCEPTION_STATUS: tuple[tuple[type[Exception], int, str], ...] = (
    (UnknownModelError, 404, "model_not_found"),
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


# -- HTTP --------------------------------------------------------------------------------------

_GONE = web.RequestKey("client_gone", bool)
_ASKED_FOR: web.RequestKey[str] = web.RequestKey("deskfleet_asked_for", str)  # the model the request named
_USAGE: web.RequestKey[tuple[int, int]] = web.RequestKey("deskfleet_usage", tuple)  # (prompt, completion) tokens
_TTFT: web.RequestKey[float] = web.RequestKey("deskfleet_ttft", float)  # seconds to the first token
_BUDGET_NOTE: web.RequestKey[str] = web.RequestKey("deskfleet_budget_note", str)  # the 80 % warning
# (model, ring) once a ring has answered the request: what the audit records
SERVED_BY: web.RequestKey[tuple[str, str]] = web.RequestKey("deskfleet_served_by", tuple)
CALLER: web.RequestKey[Caller] = web.RequestKey("deskfleet_caller", Caller)  # who sent it (a valid key)
_TOKEN: web.RequestKey[str] = web.RequestKey("deskfleet_token", str)  # the bearer key it carried
API_STATE: web.AppKey[_Api] = web.AppKey("deskfleet_api")  # RunningApi.set_api_key reaches it



def as_router(generator: Generator, model_name: str | None = None) -> Router:
    """``generator`` itself when it is a Router, else a Router serving it as its one ring "default"."""
    if isinstance(generator, Router):
        return generator
    router = Router()
    router.add_ring("default", generator, model_name=model_name)
    return router


def _served_by(request: web.Request, model: str, ring: str) -> None:
    """Note on ``request`` the model and ring that answer it (the audit's, and the stages header's)."""
    request[SERVED_BY] = (model, ring)


class _Api:
    def __init__(self, generator: Generator, tokenizer: Tokenizers, settings: ApiSettings, hosts: HostPolicy,
                 keys: KeyBook | None = None, audit: AuditLog | None = None):
        self.router = as_router(generator, settings.model_name)
        self.generator: Generator = self.router
        self.settings = settings
        self.hosts = hosts
        self.metrics = ApiMetrics()  # its own registry: /metrics shows this server's figures only
        self.metrics.use_generator(DictCollector(self.generator.metrics))
        self.keys = KeyCheck(settings.api_key, keys)
        limiter = RateLimiter()
        self.audit = audit
        # a completion's stages, in the order it passes them (the door first: it needs only the caller)
        self.door = Door(limiter, self.metrics, settings.max_concurrent, settings.retry_after_s)
        shares = StreamShares(settings.key_streams or max(1, settings.max_concurrent // 2))
        self.admission = Admission(self.keys, shares)
        self.generation = Generation(self.router, tokenizer, settings, limiter, self.metrics)
        self.responses = ResponseStore()  # /v1/responses kept for GET, DELETE and previous_response_id
        book = keys
        self.usage = UsageLedger(lambda: book.db) if book is not None else None  # usage and budgets

    def _pending(self) -> frozenset[str]:
        """The features refused now: the settings' pending ones that some ring does not honour
        (none while no ring serves: the request then gets the router's 503)."""
        rings = self.router.rings().values()
        if not rings:
            return frozenset()
        honoured = frozenset.intersection(*(frozenset(getattr(g, "features", ())) for g in rings))
        return self.settings.pending - honoured

    @web.middleware
    async def errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        started, status = time.time(), CLIENT_CLOSED
        try:
            try:
                # cheapest first: a page on another site (Host), a stranger (key), a form (type)
                self.hosts.check(request.headers.get("Host"))
                request[CALLER] = self._authorize(request)
                if request.method == "POST":
                    check_json_type(request.content_type)
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
            status = CLIENT_CLOSED if request.get(_GONE) else response.status
            self.metrics.count(status)
            return response
        finally:
            self._audit(request, status, started)
            self._record_usage(request, status, started)

    def _record_usage(self, request: web.Request, status: int, started: float) -> None:
        """A completion's usage row (:mod:`engine.api.usage`): never its text."""
        caller = request.get(CALLER)
        if self.usage is None or caller is None or _USAGE not in request:
            return
        model, ring = request.get(SERVED_BY, (request.get(_ASKED_FOR), None))
        prompt, completion = request[_USAGE]
        if self.usage.record(caller, model=model or "", ring=ring or "", prompt_tokens=prompt,
                             completion_tokens=completion, ttft_s=request.get(_TTFT),
                             duration_s=time.time() - started, status=status):
            start_task(off_loop(self._housekeeping), name="usage roll-up", logger=log)

    def _housekeeping(self) -> None:
        """Hourly, off the loop: old usage rows folded into days, long-revoked keys forgotten (L11)."""
        if self.usage is not None:
            self.usage.roll_up()
        if self.keys.book is not None and (pruned := self.keys.book.prune_revoked()):
            log.info("forgot %d key(s) revoked over %d days ago: %s", len(pruned), KEEP_REVOKED_DAYS,
                     ", ".join(pruned))

    def _audit(self, request: web.Request, status: int, started: float) -> None:
        """The request's audit line: its key's name, model and ring, status, token counts, duration."""
        if self.audit is None or request.path in PUBLIC_PATHS:
            return
        caller = request.get(CALLER)
        if caller is None:  # a stranger (no valid key, or a foreign Host): counted, not a line each
            self.audit.refused(request.remote, status)
            return
        model, ring = request.get(SERVED_BY, (request.get(_ASKED_FOR), None))
        usage = request.get(_USAGE, (0, 0))
        self.audit.write(AuditRecord(
            time=utc_stamp(started), key=caller.name, method=request.method,
            path=request.path[:200], model=model, ring=ring, status=status, prompt_tokens=usage[0],
            completion_tokens=usage[1], duration_ms=round((time.time() - started) * 1000, 1), remote=request.remote))

    def set_api_key(self, key: str) -> None:
        self.keys.set_static(key)

    def _authorize(self, request: web.Request) -> Caller:
        """The caller a request's bearer key names; ApiError 401 for none, a wrong or a revoked one
        (``/health`` needs none)."""
        if not self.keys.required:
            return ANONYMOUS
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        caller = None
        if scheme.lower() == "bearer" and token.strip():
            request[_TOKEN] = token.strip()  # looked up again while its answers run (KeyWatch)
            try:
                caller = self.keys.identify(token.strip())
            except KeyBookError as exc:
                log.error("refusing every key: %s", exc)
                raise ApiError(503, "the server cannot read its API key book; the admin must repair it "
                               "(the server log says how)", "key_book_unreadable") from None
        if caller is None:
            if request.path in PUBLIC_PATHS:
                return ANONYMOUS
            raise ApiError(401, "missing, wrong or revoked API key; send 'Authorization: Bearer <key>' with a "
                           "key the fleet's admin issued you", "invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return caller

    def _card(self, request: web.Request) -> ModelCard | None:
        """The model a request was answered by, else the first served model (None: none served)."""
        model = request.get(SERVED_BY, (None, ""))[0]
        with contextlib.suppress(UnknownModelError, UnavailableError):
            return self.router.card_for(model)
        return None

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        card = self._card(request)
        if card is not None:
            response.headers[STAGES_HEADER] = str(card.stages)
        if (note := request.get(_BUDGET_NOTE)) is not None:
            response.headers[WARNING_HEADER] = note

    def _stranger(self, request: web.Request) -> bool:
        """True for a caller without a valid key on a server that requires one."""
        return self.keys.required and request.get(CALLER, ANONYMOUS) is ANONYMOUS

    async def health(self, request: web.Request) -> web.Response:
        """Every ring's report; 200 while the service can serve (ok or recovering), 503 when it cannot.

        ``model`` and ``stages`` (the first model's) and ``active_requests`` are kept for one-ring clients.
        A caller without a key (where keys are required) gets the bare ``status``: ring ids, models,
        counts and failure details are for key holders."""
        reports = self.router.ring_reports()
        status = overall_status(reports)
        if self._stranger(request):
            return web.json_response({"status": status.value}, status=503 if status is RingStatus.DOWN else 200,
                                     headers={"Cache-Control": "no-store"})
        card = self._card(request)
        body: dict[str, Any] = {"status": status.value, "rings": [r.to_json() for r in reports],
                                "active_requests": self.metrics.active}
        if card is not None:
            body |= {"model": card.name, "stages": card.stages}
        return web.json_response(body, status=503 if status is RingStatus.DOWN else 200,
                                 headers={"Cache-Control": "no-store"})

    async def prometheus(self, request: web.Request) -> web.Response:
        """The counters, for the operator: where keys are required, only to the one fixed key, the
        console's key or a key issued with ``--metrics`` (they count every user's traffic)."""
        caller = request.get(CALLER, ANONYMOUS)
        if self.keys.required and not caller.metrics:
            raise ApiError(403, f"the key {caller.name!r} may not read /metrics; the fleet's admin can issue a key "
                           "for monitoring with 'deskfleet keys issue NAME --metrics'", "metrics_forbidden")
        return web.Response(body=render(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE, "Cache-Control": "no-store"})

    def _model_entry(self, card: ModelCard) -> dict[str, Any]:
        """A model as /v1/models lists it, with what it can do here (``capabilities``)."""
        try:
            thinks = getattr(self.generation.tokenizer_for(card.name), "thinking", None) is not None
        except UnavailableError:
            thinks = False
        refused = self._pending()  # features some ring behind this API does not honour
        return {"id": card.name, "object": "model", "created": 0, "owned_by": "deskfleet",
                "context_length": card.context_length,
                "capabilities": {"chat": True, "completions": True, "responses": True, "embeddings": False,
                                 "tools": True, "thinking": thinks,
                                 "structured_output": "response_format" not in refused,
                                 "logprobs": "logprobs" not in refused}}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_entry(c) for c in self.router.models()]})

    async def model(self, request: web.Request) -> web.Response:
        cards = {c.name: c for c in self.router.models()}
        name = request.match_info["model"]
        if name not in cards:
            raise model_not_found(name, tuple(cards))
        return web.json_response(self._model_entry(cards[name]))

    async def _read_body(self, request: web.Request) -> bytes:
        too_large = ApiError(413, f"the request body exceeds {self.settings.max_body_bytes} bytes; "
                             "send a shorter prompt", "request_too_large")
        if (request.content_length or 0) > self.settings.max_body_bytes:
            raise too_large
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None

    async def complete(self, kind: str, request: web.Request) -> web.StreamResponse:
        """Answer /v1/chat/completions (``kind`` "chat") or /v1/completions ("text"): the door, then
        parse → admit → generate → shape (the module docstring). Each of the ``n`` choices is a
        generation of its own (the ring's prefix cache shares the prompt)."""
        started = time.perf_counter()
        caller = request.get(CALLER, ANONYMOUS)
        tally = Tally()
        try:
            self._check_budget(request, caller)
            with self.door.enter(caller):  # the key's rate limit and a slot, before the body is read
                params = await self._parse(kind, request)  # 1. parse
                with self.admission.admit(caller, params, request.get(_TOKEN)) as admitted:  # 2. admit
                    prepared = await self.generation.prepare(params, admitted, tally)  # 3. generate
                    placed = functools.partial(_served_by, request, prepared.card.name)
                    streams = self.generation.streams(prepared, admitted, tally, started, placed)
                    async with contextlib.aclosing(Answer(params, prepared, streams, tally)) as answer:  # 4. shape
                        if params.stream:
                            return await self._send_stream(request, answer)
                        body = await answer.whole()
        finally:
            request[_USAGE] = (tally.prompt_tokens, tally.completion_tokens)
            if tally.first_token_at is not None:
                request[_TTFT] = tally.first_token_at - started
        return web.json_response(body)

    def _check_budget(self, request: web.Request, caller: Caller) -> None:
        """ApiError 429 when the caller's key or group has used a token budget; the 80 % warning noted."""
        if self.usage is None:
            return
        verdict = self.usage.check(caller)
        if verdict.over is not None:
            wait = verdict.over.retry_after(datetime.datetime.now(datetime.UTC))
            raise ApiError(429, verdict.over.refusal(), "budget_exceeded",
                           headers={"Retry-After": retry_after_header(wait)})
        if verdict.warning is not None:
            request[_BUDGET_NOTE] = verdict.warning.warning()

    async def _parse(self, kind: str, request: web.Request) -> CompletionParams:
        """The parse stage on the request's body, with what the server serves now."""
        raw = await self._read_body(request)
        served, pending = [c.name for c in self.router.models()], self._pending()
        body = parse_json_body(raw)
        if (asked := requested_model(body)) is not None:  # for the audit, even when it is not served
            request[_ASKED_FOR] = asked
        return parse_completion(body, kind, served, pending=pending, max_prompt_tokens=self.settings.max_prompt_tokens)

    # -- /v1/responses: the same four stages, a Responses body parsed and a Response shaped ----------

    async def respond(self, request: web.Request) -> web.StreamResponse:
        """Answer POST /v1/responses (:mod:`engine.api.responses_schema` parses it into the chat request
        it means; :mod:`engine.api.responses_answer` shapes the answer)."""
        started, caller, tally = time.perf_counter(), request.get(CALLER, ANONYMOUS), Tally()
        try:
            self._check_budget(request, caller)
            with self.door.enter(caller):
                body = parse_json_body(await self._read_body(request))
                if (asked := requested_model(body)) is not None:
                    request[_ASKED_FOR] = asked
                previous = self._previous(caller, body.get("previous_response_id"))
                params = parse_response_request(body, [c.name for c in self.router.models()], previous=previous,
                                                pending=self._pending(),
                                                max_prompt_tokens=self.settings.max_prompt_tokens)
                chat = params.chat
                with self.admission.admit(caller, chat, request.get(_TOKEN)) as admitted:
                    prepared = await self.generation.prepare(chat, admitted, tally)
                    placed = functools.partial(_served_by, request, prepared.card.name)
                    streams = self.generation.streams(prepared, admitted, tally, started, placed)
                    shape = ResponseShape(params, prepared.card.name)
                    async with contextlib.aclosing(Answer(chat, prepared, streams, tally)) as answer:

                        def ending() -> tuple[dict[str, Any], dict[str, int]]:
                            choice = answer.choices()[0]
                            if params.store:
                                conversation = (*params.conversation, *output_conversation(choice["message"]))
                                self.responses.put(caller.name, shape.whole(choice, answer.usage()), conversation)
                            return choice, answer.usage()

                        if chat.stream:
                            await answer.first()
                            return await self._send_events(request, shape.events(answer.deltas(), ending), error_event)
                        await answer.whole()
                        choice, usage = ending()
                        return web.json_response(shape.whole(choice, usage))
        finally:
            request[_USAGE] = (tally.prompt_tokens, tally.completion_tokens)
            if tally.first_token_at is not None:
                request[_TTFT] = tally.first_token_at - started

    def _previous(self, caller: Caller, previous_id: Any) -> tuple[dict[str, Any], ...]:
        if previous_id is None:
            return ()
        stored = self.responses.get(caller.name, previous_id) if isinstance(previous_id, str) else None
        if stored is None:
            raise ApiError(404, f"previous_response_id {str(previous_id)[:80]!r} names no response kept for this "
                           "key (responses are kept a day, and not across a restart of the service); send the "
                           "whole conversation in 'input' instead", "response_not_found", param="previous_response_id")
        return stored.conversation

    async def get_response(self, request: web.Request) -> web.Response:
        stored = self.responses.get(request.get(CALLER, ANONYMOUS).name, request.match_info["id"])
        if stored is None:
            raise ApiError(404, f"no response {request.match_info['id'][:80]!r} is kept for this key",
                           "response_not_found")
        return web.json_response(stored.response)

    async def delete_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["id"]
        if not self.responses.delete(request.get(CALLER, ANONYMOUS).name, response_id):
            raise ApiError(404, f"no response {response_id[:80]!r} is kept for this key", "response_not_found")
        return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    async def _send_stream(self, request: web.Request, answer: Answer) -> web.StreamResponse:
        # Wait for the first token before sending headers so refusals (429/503) keep their status.
        await answer.first()
        return await self._send_events(request, answer.events(), lambda error: sse_event(error.body()))

    async def _send_events(self, request: web.Request, events: AsyncGenerator[bytes, None],
                           error_event: Callable[[ApiError], bytes]) -> web.StreamResponse:
        """Stream ``events`` (bytes) as server-sent events; an error after the headers goes in-band
        as ``error_event`` shapes it (chat's error chunk, or the Responses ``error`` event), as OpenAI does."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    await response.write(event)
        except ConnectionResetError:
            request[_GONE] = True
            log.debug("client left during a streamed answer; generation cancelled")
        except Exception as exc:
            error = api_error_from(exc)
            if error.status == 500:
                log.exception("generation failed mid-stream")
            with contextlib.suppress(ConnectionResetError):
                await response.write(error_event(error))
        return response


def build_app(generator: Generator, tokenizer: Tokenizers, settings: ApiSettings,
              host: str = "127.0.0.1", *, keys: KeyBook | None = None,
              audit: AuditLog | None = None) -> web.Application:
    """The aiohttp application serving ``generator`` under the OpenAI API, within ``settings``' limits.

    ``generator``: a :class:`Router` (its models, each with ``tokenizer[name]`` when ``tokenizer``
    is a mapping) or a lone generator (served as a one-ring router named ``settings.model_name``).

    ``host`` is the address it will be bound to: with ``settings.allowed_hosts`` and the loopback
    names, what a request's ``Host`` header may name. ``keys``: the fleet's key book (every
    request but ``/health`` must carry a live key of it, or ``settings.api_key``); ``audit``:
    where each request's audit line goes (None: not audited)."""
    api = _Api(generator, tokenizer, settings, HostPolicy(host, settings.allowed_hosts), keys, audit)
    app = web.Application(middlewares=[api.errors], client_max_size=settings.max_body_bytes)
    app.on_response_prepare.append(api.add_headers)
    app[API_STATE] = api
    app.router.add_post("/v1/chat/completions", functools.partial(api.complete, "chat"))
    app.router.add_post("/v1/completions", functools.partial(api.complete, "text"))
    app.router.add_post("/v1/responses", api.respond)
    app.router.add_get("/v1/responses/{id}", api.get_response)
    app.router.add_delete("/v1/responses/{id}", api.delete_response)
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
    tls: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/v1"

    async def async_stop(self) -> None:
        """Stop listening, give in-flight requests the runner's grace period, then cancel them; the
        audit's pending summary of strangers is written."""
        await self.runner.cleanup()
        audit = self.runner.app[API_STATE].audit
        if audit is not None:
            audit.close()

    @property
    def metrics(self) -> ApiMetrics:
        """The server's metrics; its ``registry`` is what ``/metrics`` renders (a fleet service adds its
        own collectors there, and :meth:`ApiMetrics.use_generator` replaces the generator's)."""
        return self.runner.app[API_STATE].metrics

    def set_api_key(self, key: str) -> None:
        """Require ``key`` from the next request on (the console rotated its key: the old one is
        refused at once, requests already admitted run on)."""
        if not key:
            raise ValueError("an empty API key would turn auth off; pass a key")
        self.runner.app[API_STATE].set_api_key(key)


async def async_run_api(generator: Generator, tokenizer: Tokenizers, settings: ApiSettings,
                        host: str = "127.0.0.1", port: int = 0, *, shutdown_timeout: float = 5.0,
                        ssl_context: ssl.SSLContext | None = None, keys: KeyBook | None = None,
                        audit: AuditLog | None = None) -> RunningApi:
    """Serve the API on ``host:port`` (0 picks a free port) in the running loop; return the bound port.

    ``ssl_context``: serve HTTPS (the fleet service passes its certificate's server context,
    clients need none); without it only a loopback ``host`` is allowed
    (:func:`~engine.api.guard.check_exposure`).
    ``keys``, ``audit``: see :func:`build_app`. A client that disconnects cancels its handler,
    which closes its token stream.
    """
    check_exposure(host, tls=ssl_context is not None)
    app = build_app(generator, tokenizer, settings, host, keys=keys, audit=audit)
    runner = LimitedAppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout, what="OpenAI API")
    await runner.setup()
    try:
        site = LimitedSite(runner, host, port, ssl_context=ssl_context)
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise DeskfleetError(f"cannot listen on {host}:{port} ({exc}); pick another --port or stop "
                               "the program using it") from exc
    return RunningApi(runner, host, runner.addresses[0][1], tls=ssl_context is not None)
