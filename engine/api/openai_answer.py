"""Stage 4 of a request, shape: each choice's typed events in, the OpenAI answer out.

An :class:`Answer` follows the events of a request's choices (:mod:`engine.api.generate`, the
stage before) and gives the whole JSON answer (:meth:`Answer.whole`) or its server-sent events
(:meth:`Answer.first`, then :meth:`Answer.events`); the HTTP layer only moves the bytes. A choice
whose text reached a stop string closes its event stream, which cancels its generation.

A :class:`ChoiceBuilder` follows one choice's token events: it turns ids into text deltas (stop
strings included, :class:`~engine.api.text_stream.TextStream`), splits tool calls out of the
text when the request gave tools (:class:`~engine.generation.tool_calls.ToolCallStream`), splits a
thinking model's reasoning into ``reasoning_content`` (:mod:`engine.generation.reasoning`), and
collects the tokens' log-probabilities when asked; it answers with the choice's streamed deltas
(:meth:`ChoiceBuilder.push`) or its whole body (:meth:`ChoiceBuilder.choice`).
:func:`completion_response` and :class:`CompletionChunks` put the choices into OpenAI's shapes.

Log-probabilities come as the generators give them on each token event (chat: ``logprobs.content``
of ``{token, logprob, bytes, top_logprobs}``; completions: ``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``). A token's text is the text of its bytes (a piece of a
multi-byte character shows as U+FFFD there; its ``bytes`` are exact). End-of-sequence tokens are
not listed.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Collection, Mapping, Sequence
from typing import Any

from engine.api.fan_in import merged
from engine.api.generate import ChoiceEvent, End, Prepared, Tally
from engine.api.openai_schema import CompletionParams
from engine.api.text_stream import TextStream
from engine.generation.reasoning import ReasoningDelta, ReasoningSplitter, opens_thinking
from engine.generation.request import TokenEvent
from engine.generation.tool_calls import ArgumentsDelta, CallStart, ContentDelta, Piece, ToolCallStream

TokenBytes = Callable[[int], bytes]
# The prompt's last tokens that say whether the template opened the thinking block (an open marker,
# or Qwen3's empty "<think>\n\n</think>\n\n" with thinking off, after the assistant's header).
PROMPT_TAIL_TOKENS = 8


def token_bytes_of(tokenizer: Any) -> TokenBytes:
    """A tokenizer's ``token_bytes`` (:class:`~engine.generation.tokenizer.ChatTokenizer`), else the
    UTF-8 of the token decoded alone."""
    exact = getattr(tokenizer, "token_bytes", None)
    if exact is not None:
        return exact
    return lambda token_id: tokenizer.decode([token_id]).encode("utf-8")


def thinking_of(tokenizer: Any, prompt_ids: Sequence[int]) -> ReasoningSplitter | None:
    """A splitter of the thinking block for a model whose template thinks (``tokenizer.thinking``),
    opened already when the prompt's last tokens leave the block open; None otherwise."""
    markers = getattr(tokenizer, "thinking", None)
    if markers is None:
        return None
    tail = tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
    return ReasoningSplitter(markers, opened=opens_thinking(tail, markers))


class ChoiceBuilder:
    """One choice of an answer, built from its token events (chat: ``kind`` "chat"; else "text").
    ``tools``: the names of the request's functions; its text is parsed for calls of those only
    (empty: not parsed)."""

    def __init__(self, index: int, kind: str, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (), *,
                 tools: Collection[str] = (), logprobs: int | None = None, token_bytes: TokenBytes | None = None,
                 skip_ids: Collection[int] = (), thinking: ReasoningSplitter | None = None):
        self.index, self.kind = index, kind
        self.text = TextStream(decode, stop)
        self._thinking = thinking if kind == "chat" else None
        self._tools = ToolCallStream(declared=tools) if tools else None  # only the request's functions
        self._logprobs = logprobs
        self._token_bytes = token_bytes or (lambda token_id: decode([token_id]).encode("utf-8"))
        self._skip = frozenset(skip_ids)
        self._entries: list[dict[str, Any]] = []  # every listed token's entry, in order
        self._sent_entries = 0  # entries already attached to a streamed chunk
        self._content: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None

    @property
    def stopped(self) -> bool:
        """A stop string ended the text: the caller should close the choice's token stream."""
        return self.text.stopped

    @property
    def tool_calls(self) -> tuple:
        return tuple(self._tools.calls) if self._tools is not None else ()

    def push(self, event: TokenEvent) -> list[dict[str, Any]]:
        """Add one token event; the streamed choice deltas it makes ready (maybe none)."""
        delta = self.text.push(event.token_id)
        offset = self.text.offsets[-1]
        if self._logprobs is not None and event.token_id not in self._skip:
            self._entries.append(self._entry(event, offset))
        return self._deltas(self._pieces(delta))

    def close(self, finish_reason: str, stop_reason: str | None = None) -> list[dict[str, Any]]:
        """Generation ended with ``finish_reason``: the held text, then the closing delta (with
        ``stop_reason`` when the server, not the model, ended it: "token_budget")."""
        self.stop_reason = stop_reason
        tail = self._pieces(self.text.finish(), final=True)
        if self._tools is not None:
            tail += self._tools.finish()
        if self._tools is not None and self._tools.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        self.finish_reason = finish_reason
        out = self._deltas(tail)
        out.append(self._delta({}, "", finish_reason))
        return out

    # -- pieces and deltas ---------------------------------------------------------------------

    def _pieces(self, text: str, final: bool = False) -> list[Piece | ReasoningDelta]:
        """The text's pieces: thinking split off first (for a model that thinks), then tool calls."""
        if self._thinking is None:
            return self._answer_pieces(text)
        pieces: list[Piece | ReasoningDelta] = []
        for part in self._thinking.push(text) + (self._thinking.finish() if final else []):
            pieces += [part] if isinstance(part, ReasoningDelta) else self._answer_pieces(part.text)
        return pieces

    def _answer_pieces(self, text: str) -> list[Piece | ReasoningDelta]:
        if not text:
            return []
        return [ContentDelta(text)] if self._tools is None else list(self._tools.push(text))

    def _deltas(self, pieces: list[Piece | ReasoningDelta]) -> list[dict[str, Any]]:
        out = []
        for piece in pieces:
            if isinstance(piece, ReasoningDelta):
                out.append(self._delta({"reasoning_content": piece.text}, "", None))
            elif isinstance(piece, ContentDelta):
                self._content.append(piece.text)
                out.append(self._delta({"content": piece.text}, piece.text, None))
            elif isinstance(piece, CallStart):
                call = {"index": piece.index, "id": piece.id, "type": "function",
                        "function": {"name": piece.name, "arguments": ""}}
                out.append(self._delta({"tool_calls": [call]}, "", None))
            elif isinstance(piece, ArgumentsDelta):
                call = {"index": piece.index, "function": {"arguments": piece.fragment}}
                out.append(self._delta({"tool_calls": [call]}, "", None))
        return out

    def _delta(self, chat_delta: dict[str, Any], text: str, finish: str | None) -> dict[str, Any]:
        """A streamed choice carrying the log-probabilities of the tokens not yet sent."""
        entries = self._entries[self._sent_entries:]
        self._sent_entries = len(self._entries)
        logprobs = self._logprob_body(entries) if self._logprobs is not None and (entries or finish) else None
        why = {"stop_reason": self.stop_reason} if finish and self.stop_reason else {}
        if self.kind == "chat":
            return {"index": self.index, "delta": chat_delta, "finish_reason": finish, "logprobs": logprobs, **why}
        return {"index": self.index, "text": text, "finish_reason": finish, "logprobs": logprobs, **why}

    # -- log-probabilities ---------------------------------------------------------------------

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        raw = self._token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _entry(self, event: TokenEvent, offset: int) -> dict[str, Any]:
        text, raw = self._token(event.token_id)
        top = []
        for token_id, logprob in event.top_logprobs[:self._logprobs]:
            alt, alt_raw = self._token(token_id)
            top.append({"token": alt, "logprob": logprob, "bytes": alt_raw})
        return {"token": text, "logprob": event.logprob, "bytes": raw, "top_logprobs": top, "offset": offset}

    def _logprob_body(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        if self.kind == "chat":
            return {"content": [{k: v for k, v in e.items() if k != "offset"} for e in entries], "refusal": None}
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": [e["offset"] for e in entries]}

    # -- the whole choice ----------------------------------------------------------------------

    def choice(self) -> dict[str, Any]:
        """The choice of a non-streamed answer (after :meth:`close`)."""
        logprobs = self._logprob_body(self._entries) if self._logprobs is not None else None
        text = "".join(self._content)
        why = {"stop_reason": self.stop_reason} if self.stop_reason else {}
        if self.kind != "chat":
            return {"index": self.index, "text": text, "finish_reason": self.finish_reason, "logprobs": logprobs,
                    **why}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tool_calls:
            message = {"role": "assistant", "content": text.strip() or None,
                       "tool_calls": [c.to_json() for c in self.tool_calls]}
        if self._thinking is not None:
            message["reasoning_content"] = self._thinking.reasoning or None
        return {"index": self.index, "message": message, "finish_reason": self.finish_reason, "logprobs": logprobs,
                **why}


# -- answers and chunks --------------------------------------------------------------------------

# kind -> (id prefix, object, chunk object)
SHAPES = {
    "chat": ("chatcmpl-", "chat.completion", "chat.completion.chunk"),
    "text": ("cmpl-", "text_completion", "text_completion"),
}


def _head(prefix: str, obj: str, model: str) -> dict[str, Any]:
    return {"id": prefix + uuid.uuid4().hex, "object": obj, "created": int(time.time()), "model": model}


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The ``usage`` object of an answer (``completion_tokens``: every choice's)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(kind: str, model: str, choices: Sequence[Mapping[str, Any]],
                        usage: Mapping[str, int]) -> dict[str, Any]:
    """The whole (non-streamed) answer to a ``kind`` "chat" or "text" request."""
    prefix, obj, _ = SHAPES[kind]
    return {**_head(prefix, obj, model), "choices": [dict(c) for c in choices], "usage": dict(usage)}


class CompletionChunks:
    """The chunks of one streamed answer; each repeats the same id, object, created and model.

    With ``include_usage`` every chunk carries ``"usage": null`` and :meth:`usage` gives the last one.
    """

    def __init__(self, kind: str, model: str, include_usage: bool = False, n: int = 1):
        prefix, _, obj = SHAPES[kind]
        self._kind, self._n = kind, n
        self._head = _head(prefix, obj, model)
        self._extra = {"usage": None} if include_usage else {}

    def opening(self) -> list[dict[str, Any]]:
        """The chunks sent before any text: a chat answer first announces the assistant role of each choice."""
        if self._kind != "chat":
            return []
        return [{**self._head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None, "logprobs": None}], **self._extra}
                for i in range(self._n)]

    def chunk(self, choice: Mapping[str, Any]) -> dict[str, Any]:
        """A chunk carrying one streamed choice delta (:meth:`ChoiceBuilder.push`)."""
        return {**self._head, "choices": [dict(choice)], **self._extra}

    def usage(self, usage: Mapping[str, int]) -> dict[str, Any]:
        """The closing chunk of an ``include_usage`` stream: no choices, the token counts."""
        return {**self._head, "choices": [], "usage": dict(usage)}


def sse_event(payload: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <compact JSON or the literal string>`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


# -- one request's answer ----------------------------------------------------------------------------

Deltas = list[dict[str, Any]]  # a choice's streamed deltas made ready by one event (maybe none)


async def choice_deltas(events: AsyncGenerator[ChoiceEvent, None],
                        builder: ChoiceBuilder) -> AsyncGenerator[Deltas, None]:
    """One choice's deltas per event, then its held-back tail and closing delta. A stop string in
    the text ends it there: its event stream is closed (the generation cancelled)."""
    async with contextlib.aclosing(events):
        async for item in events:
            if isinstance(item, End):
                yield builder.close(item.finish, item.stop_reason)
                return
            yield builder.push(item.event)
            if builder.stopped:
                break
    yield builder.close("stop")


class Answer:
    """The answer to one request: its choices built from their event streams (one per choice, in
    order), read all at once (:meth:`whole`) or as a stream (:meth:`first`, :meth:`events`).
    ``tally`` is the request's token counts, for ``usage``. Close it (``aclose``) when done."""

    def __init__(self, params: CompletionParams, prepared: Prepared,
                 streams: Sequence[AsyncGenerator[ChoiceEvent, None]], tally: Tally) -> None:
        tokenizer, card, ids = prepared.tokenizer, prepared.card, prepared.prompt_ids
        self._params, self._model, self._tally = params, card.name, tally
        self._builders = [ChoiceBuilder(i, params.kind, tokenizer.decode, params.stop, tools=params.callable_tools,
                                        logprobs=params.logprobs, token_bytes=token_bytes_of(tokenizer),
                                        skip_ids=card.eos_token_ids, thinking=thinking_of(tokenizer, ids))
                          for i in range(params.n)]
        self._deltas = merged([choice_deltas(s, b) for s, b in zip(streams, self._builders, strict=True)])
        self._ready: Deltas | None = None

    def usage(self) -> dict[str, int]:
        return token_usage(self._tally.prompt_tokens, self._tally.completion_tokens)

    async def whole(self) -> dict[str, Any]:
        """The whole (non-streamed) answer, once every choice has ended."""
        async for _ in self._deltas:
            pass
        return completion_response(self._params.kind, self._model, self.choices(), self.usage())

    async def first(self) -> None:
        """Wait for the first token's deltas (so that a refusal, 429 or 503, can still be an HTTP status)."""
        self._ready = await anext(self._deltas, None)

    async def deltas(self) -> AsyncGenerator[Deltas, None]:
        """The choices' streamed deltas after :meth:`first`, as they become ready (for another shape
        of stream: :mod:`engine.api.responses_answer`)."""
        ready = self._ready
        while ready is not None:
            yield ready
            ready = await anext(self._deltas, None)

    def choices(self) -> list[dict[str, Any]]:
        """Each choice's whole body, once the answer has ended (as :meth:`whole` gives them)."""
        return [b.choice() for b in self._builders]

    async def events(self) -> AsyncGenerator[bytes, None]:
        """The answer's server-sent events after :meth:`first`: the opening chunks, a chunk per
        delta, the usage chunk when asked, then ``[DONE]``."""
        chunks = CompletionChunks(self._params.kind, self._model, self._params.include_usage, self._params.n)
        for chunk in chunks.opening():
            yield sse_event(chunk)
        async for ready in self.deltas():
            for choice in ready:
                yield sse_event(chunks.chunk(choice))
        if self._params.include_usage:
            yield sse_event(chunks.usage(self.usage()))
        yield sse_event("[DONE]")

    async def aclose(self) -> None:
        """Close every choice's stream (cancelling what still generates)."""
        await self._deltas.aclose()
