"""Stage 3 of a request, generate: an admitted request in, each choice's typed events out.

:meth:`Generation.prepare` resolves the request's model (its card and tokenizer), renders and
tokenises the prompt off the loop (:func:`prompt_ids`) and makes one id-level
:class:`~engine.generation.request.GenerationRequest` per choice within the server's limits and
the model's context (:func:`to_generation_requests`: the refusals that need the token count are
here, 400 ``context_length_exceeded``), in the key's own cache scope and as its principal's (the
paged scheduler's fair share, :mod:`engine.paged.fair_share`). :meth:`Generation.streams`
runs each choice through the router and yields its :class:`Token` events, then one :class:`End`
(the OpenAI ``finish_reason``, and ``stop_reason`` when the server stopped it). Tokens are charged
to the caller's key as they come: a stream stops when the key runs out of tokens
(:data:`~engine.api.share.BUDGET_STOP`) and fails when the key is revoked.

The stage before is :mod:`engine.api.admit` (what it admitted is :class:`~engine.api.admit.Admitted`);
the stage after, :mod:`engine.api.openai_answer`, shapes the events. Closing a choice's event
stream (a stop string, a client gone) cancels its generation.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from engine.api.admit import Admitted
from engine.api.api_error import ApiError, bad_request
from engine.api.api_metrics import ApiMetrics
from engine.api.keys import RateLimiter
from engine.api.off_loop import off_loop
from engine.api.openai_schema import CompletionParams
from engine.api.share import BUDGET_STOP
from engine.generation.generator import ModelCard, UnavailableError
from engine.generation.reasoning import template_switches
from engine.generation.request import FinishReason, GenerationRequest, TokenEvent
from engine.generation.router import Router
from engine.generation.tokenizer import ChatTokenizer
from engine.generation.tool_calls import conversation

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}  # a generator's -> OpenAI's
Tokenizers = ChatTokenizer | Mapping[str, ChatTokenizer]  # one for every model, or one per served model name


class TokenLimits(Protocol):
    """The server's token limits that :func:`to_generation_request` enforces (``engine.api.server.ApiSettings``)."""

    @property
    def max_prompt_tokens(self) -> int: ...

    @property
    def default_max_tokens(self) -> int: ...

    @property
    def max_tokens_limit(self) -> int: ...


class PromptTokenizer(Protocol):
    """What :func:`prompt_ids` needs of a tokenizer (:class:`~engine.generation.tokenizer.ChatTokenizer`)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None) -> list[int]: ...


# -- the prompt as ids -----------------------------------------------------------------------------

def check_prompt_ids(params: CompletionParams, vocab_size: int | None) -> None:
    """Raise ApiError 400 for a prompt of token ids outside the model's vocabulary (``vocab_size``;
    None: not known, the parse's int32 bound holds)."""
    if vocab_size is None or not isinstance(params.prompt, tuple):
        return
    if (bad := next((t for t in params.prompt if t >= vocab_size), None)) is not None:
        raise ApiError(400, f"'prompt' holds the token id {bad}; this model's vocabulary has ids 0 to "
                       f"{vocab_size - 1}", "invalid_value", param="prompt")


def check_logit_bias(params: CompletionParams, vocab_size: int | None) -> None:
    """Raise ApiError 400 for a ``logit_bias`` naming a token id outside the model's vocabulary
    (``vocab_size``; None: not known, and the stream fails at its first token instead)."""
    bias = params.sampling.logit_bias
    if vocab_size is not None and bias and bias[-1][0] >= vocab_size:  # ids ascending
        raise ApiError(400, f"'logit_bias' names the token id {bias[-1][0]}; this model's vocabulary has ids 0 to "
                       f"{vocab_size - 1}", "invalid_value", param="logit_bias")


def prompt_ids(tokenizer: PromptTokenizer, params: CompletionParams) -> list[int]:
    """The prompt's token ids: a chat rendered by the model's template, with its tools given to a
    template that takes them (``tokenizer.takes_tools``) or described in the conversation in the
    generic format (:func:`engine.generation.tool_calls.conversation`), and ``reasoning_effort`` as the
    template's thinking switches (:func:`engine.generation.reasoning.template_switches`); a completion
    prompt encoded."""
    if params.kind == "chat":
        messages, tools = conversation(params.messages, params.tools, params.tool_choice,
                                       native=bool(getattr(tokenizer, "takes_tools", False)))
        switches = template_switches(params.reasoning_effort, getattr(tokenizer, "template_variables", ()))
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        if switches:
            extra["switches"] = switches
        return tokenizer.encode_chat(messages, **extra)
    if isinstance(params.prompt, tuple):
        return list(params.prompt)
    return tokenizer.encode(params.prompt)


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: ``seed + index`` (wrapping within 63 bits), so seeded choices differ
    from each other and repeat across identical requests."""
    return None if seed is None else (seed + index) % (1 << 63)


def to_generation_requests(prompt_ids: Sequence[int], params: CompletionParams, limits: TokenLimits,
                           card: ModelCard) -> tuple[GenerationRequest, ...]:
    """One id-level request per choice (``params.n``), each seeded ``seed + i``."""
    first = to_generation_request(prompt_ids, params, limits, card)
    return (first, *(replace(first, sampling=replace(first.sampling, seed=choice_seed(first.sampling.seed, i)))
                     for i in range(1, params.n)))


def to_generation_request(prompt_ids: Sequence[int], params: CompletionParams, limits: TokenLimits,
                          card: ModelCard) -> GenerationRequest:
    """The id-level request for a tokenized prompt (its first choice), within the server's limits
    and the model's context."""
    n = len(prompt_ids)
    if n > limits.max_prompt_tokens or n >= card.context_length:
        limit = min(limits.max_prompt_tokens, card.context_length - 1)
        raise ApiError(400, f"the prompt has {n} tokens; this server accepts at most {limit}. "
                       "Shorten the prompt or the conversation.", "context_length_exceeded", param="messages")
    room = card.context_length - n
    if params.max_tokens is None:
        max_new = min(limits.default_max_tokens, room)
    elif params.max_tokens > limits.max_tokens_limit:
        raise bad_request(f"max_tokens is {params.max_tokens}; this server allows at most "
                          f"{limits.max_tokens_limit}", "max_tokens")
    elif params.max_tokens > room:
        raise ApiError(400, f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceed the model's "
                       f"context of {card.context_length}; ask for at most {room} tokens",
                       "context_length_exceeded", param="max_tokens")
    else:
        max_new = params.max_tokens
    return GenerationRequest(prompt_ids=tuple(prompt_ids), max_new_tokens=max_new, sampling=params.sampling,
                             stop_token_ids=card.eos_token_ids, logprobs=params.logprobs,
                             constraint=params.constraint)


# -- what this stage hands on ------------------------------------------------------------------------

@dataclass(frozen=True)
class Prepared:
    """A request ready to run: its model, the model's tokenizer, the prompt's ids and one id-level
    request per choice."""

    card: ModelCard
    tokenizer: ChatTokenizer
    prompt_ids: tuple[int, ...]
    requests: tuple[GenerationRequest, ...]


@dataclass
class Tally:
    """A request's token counts so far: its prompt (once) and every choice's generated tokens; when
    its first token came (``time.perf_counter()``; None: none yet)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None


@dataclass(frozen=True)
class Token:
    """One generated token of a choice."""

    event: TokenEvent


@dataclass(frozen=True)
class End:
    """A choice's generation ended: OpenAI's ``finish_reason``, and ``stop_reason`` when the server,
    not the model, ended it ("token_budget")."""

    finish: str = "stop"
    stop_reason: str | None = None


ChoiceEvent = Token | End


class Generation:
    """The generate stage of one API: the router behind it, its tokenizers and token limits; the
    key limiter tokens are charged to and the metrics they are counted in."""

    def __init__(self, router: Router, tokenizers: Tokenizers, limits: TokenLimits, limiter: RateLimiter,
                 metrics: ApiMetrics) -> None:
        self.router = router
        self.tokenizers = tokenizers
        self.limits = limits
        self.limiter = limiter
        self.metrics = metrics
        # one use of a tokenizer at a time: a tokenizer object is not meant to be shared between threads
        self._tokenizer_locks: dict[int, threading.Lock] = {}

    def tokenizer_for(self, model: str) -> ChatTokenizer:
        """The tokenizer of served model ``model``."""
        if isinstance(self.tokenizers, Mapping):
            if model not in self.tokenizers:
                raise UnavailableError(f"model {model!r} is served but this API has no tokenizer for it; "
                                       "the service that started the API must pass one")
            return self.tokenizers[model]
        return self.tokenizers

    async def prepare(self, params: CompletionParams, admitted: Admitted, tally: Tally) -> Prepared:
        """The request's model, its prompt rendered and tokenised (on a thread: the loop keeps
        stepping the ring), and its id-level requests in the key's cache scope; the prompt's tokens
        are counted and charged to the key."""
        card = self.router.card_for(params.model)
        tokenizer = self.tokenizer_for(card.name)
        check_prompt_ids(params, card.vocab_size)  # the model's rows: a tokenizer may name fewer ids
        check_logit_bias(params, card.vocab_size)
        ids = await off_loop(self._encode_locked, tokenizer, params)
        # the key's own prefix cache: another key's prompts are never reused, nor timed, through it;
        # and its principal, whose fair share of a ring's slots and steps its choices count against
        requests = tuple(replace(r, cache_scope=admitted.caller.scope, principal=admitted.caller.principal)
                         for r in to_generation_requests(ids, params, self.limits, card))
        tally.prompt_tokens = len(requests[0].prompt_ids)
        self.metrics.observe_prompt(tally.prompt_tokens, card.name, admitted.caller.name)
        self.limiter.charge(admitted.caller, tally.prompt_tokens)
        return Prepared(card, tokenizer, tuple(ids), requests)

    def _encode_locked(self, tokenizer: ChatTokenizer, params: CompletionParams) -> list[int]:
        with self._tokenizer_locks.setdefault(id(tokenizer), threading.Lock()):
            return prompt_ids(tokenizer, params)

    def streams(self, prepared: Prepared, admitted: Admitted, tally: Tally, started: float,
                placed: Callable[[str], None]) -> list[AsyncGenerator[ChoiceEvent, None]]:
        """Each choice's events (``placed(ring)`` once a ring takes one); ``started``: when the
        request came (``time.perf_counter()``), for the time to its first token."""
        return [self._choice(prepared.card, r, admitted, tally, started, placed) for r in prepared.requests]

    async def _choice(self, card: ModelCard, request: GenerationRequest, admitted: Admitted, tally: Tally,
                      started: float, placed: Callable[[str], None]) -> AsyncGenerator[ChoiceEvent, None]:
        """Yield a :class:`Token` per generated token, then the :class:`End`. Each token is charged to
        the caller's key before it is handed on; after it, the stream ends at the generator's finish
        or where the key ran out of tokens."""
        caller, first_at, produced, end = admitted.caller, 0.0, 0, End()
        try:
            # aclosing: leaving this block early (budget, a closed consumer, an error) cancels the request.
            async with contextlib.aclosing(self.router.stream_for(card.name, request, placed=placed)) as tokens:
                async for event in tokens:
                    if not produced:
                        first_at = time.perf_counter()
                        if not tally.completion_tokens:
                            self.metrics.observe_ttft(first_at - started, card.name)
                            tally.first_token_at = first_at
                    produced += 1
                    tally.completion_tokens += 1
                    self.limiter.charge(caller, 1)
                    if admitted.watch is not None and not admitted.watch.valid():
                        raise ApiError(401, f"the key {caller.name!r} was revoked while this answer ran; the "
                                       "answer was stopped", "invalid_api_key")
                    if event.finish is not None and event.finish not in FINISH_REASONS:
                        raise UnavailableError("the coordinator cancelled this request (it is stopping or "
                                               "a stage failed); retry it")
                    yield Token(event)
                    if event.finish is not None:
                        end = End(FINISH_REASONS[event.finish])
                        break
                    if self.limiter.over_tokens(caller):
                        end = End(*BUDGET_STOP)
                        break
            yield end
        finally:
            if produced:
                self.metrics.observe_generation(produced, time.perf_counter() - first_at, card.name, caller.name)
