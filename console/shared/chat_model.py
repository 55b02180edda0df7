"""Chat with the fleet, without Qt: conversations and messages, the streaming client for the
fleet's OpenAI-compatible API, and the tokens-per-second meter.

Two halves that never share a thread. :class:`ChatModel` holds the conversations and tells its
listeners what changed; it is mutated from one thread only (the GUI's, in the chat window).
:func:`async_stream_reply` runs on an asyncio loop, reads the server-sent events of
``/v1/chat/completions`` and hands each text delta to a callback, which the window forwards to
the model on the GUI thread. Stopping a reply is cancelling that coroutine: leaving the
``async with`` closes the HTTP response, and the server cancels the generation when its client
goes away; the text received so far stays, marked stopped. Regenerate drops the last answer and
asks its question again. The model keeps nothing on disk itself: :mod:`console.shared.conversations`
listens to its events and saves each conversation that changed.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import aiohttp

from engine.errors import DeskfleetError
from engine.trust.tls_peer import PeerIdentityError

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0  # no byte for this long mid-answer: the fleet is gone
REPLY_TIMEOUT_S = 900.0  # a whole answer; the view's call timeout
MODELS_TIMEOUT_S = 15.0

# Message states: the assistant message being streamed, and how it ended.
STREAMING, DONE, STOPPED, FAILED = "streaming", "done", "stopped", "failed"


class ChatError(DeskfleetError):
    """Raised when the fleet's chat API cannot be reached, refuses a request, or reports an error
    in the middle of a streamed answer; the message says which and what to do.

    ``status``: the HTTP status of a refusal (None when no answer came); ``code``: the API's error
    code ("unavailable", "invalid_api_key", ...) when it gave one; ``unreachable``: no answer at
    all (connection refused, a timeout, a certificate that is not the fleet's)."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 unreachable: bool = False) -> None:
        super().__init__(message)
        self.status, self.code, self.unreachable = status, code, unreachable


# -- tokens per second (pure) --------------------------------------------------------------------

@dataclass
class Throughput:
    """Decode speed of one reply: tokens after the first over the time from first to last.

    The first token's latency is the prompt's prefill, not decoding, so it is left out (as the
    API's own ``deskfleet_api_decode_tokens_per_second`` does). While streaming, each text delta
    counts as one token; the final count comes from the server's usage report when it sends one.
    """

    tokens: int = 0
    first_at: float | None = None
    last_at: float | None = None

    def add(self, at: float, tokens: int = 1) -> None:
        if self.first_at is None:
            self.first_at = at
        self.last_at = at
        self.tokens += tokens

    @property
    def per_second(self) -> float | None:
        if self.tokens < 2 or self.first_at is None or self.last_at is None or self.last_at <= self.first_at:
            return None
        return (self.tokens - 1) / (self.last_at - self.first_at)


# -- conversations -------------------------------------------------------------------------------

@dataclass
class Message:
    role: str  # "user" | "assistant" | "system"
    content: str = ""
    state: str = DONE
    error: str | None = None
    throughput: Throughput | None = None  # assistant replies only
    reasoning: str = ""  # a thinking model's reasoning before the answer (shown folded)


NEW_TITLE = "New chat"
TITLE_LENGTH = 40


def new_conversation_id(now: float | None = None) -> str:
    """``YYYYMMDD-HHMMSS-xxxxxx``: sorts by creation time, and two windows never pick the same."""
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + "-" + secrets.token_hex(3)


@dataclass
class Conversation:
    id: str
    title: str = NEW_TITLE
    messages: list[Message] = field(default_factory=list)
    created: float = 0.0  # wall-clock seconds (time.time())
    updated: float = 0.0  # the last message's; the list shows the newest first
    model: str | None = None  # the model that answered last

    @property
    def streaming(self) -> bool:
        return bool(self.messages) and self.messages[-1].state == STREAMING

    def history(self) -> list[dict[str, str]]:
        """The messages to send as context: failed replies and empty stopped ones are left out."""
        return [{"role": m.role, "content": m.content} for m in self.messages
                if m.state in (DONE, STOPPED) and (m.content or m.role == "user")]

    @property
    def can_regenerate(self) -> bool:
        """A finished answer (done, stopped or failed) follows a question: it can be asked again."""
        return (len(self.messages) >= 2 and self.messages[-1].role == "assistant"
                and self.messages[-1].state != STREAMING and self.messages[-2].role == "user")


class ChatEventKind(StrEnum):
    """What changed in the chat model."""

    ADDED = "added"  # a new conversation
    SELECTED = "selected"  # another conversation is the current one
    MESSAGE = "message"  # a message was added to a conversation
    DELTA = "delta"  # a streamed answer grew by ``text``
    ENDED = "ended"  # a streamed answer ended (done, stopped or failed)
    MODELS = "models"  # the models on offer changed
    RENAMED = "renamed"
    REMOVED = "removed"
    LISTED = "listed"  # conversations loaded from disk


@dataclass(frozen=True)
class ChatEvent:
    """What changed (``kind``) and in which conversation; ``text`` is a delta's new text."""

    kind: ChatEventKind
    conversation_id: str | None = None
    text: str = ""


class ChatModel:
    """The conversations, the current one, the models on offer. Single-threaded: see the module doc.
    ``clock``: wall-clock seconds, for the conversations' times."""

    def __init__(self, system_prompt: str | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.system_prompt = system_prompt
        self.conversations: list[Conversation] = []
        self.current_id: str | None = None
        self.models: list[str] = []
        self.model_name: str | None = None
        self._clock = clock
        self._listeners: list[Callable[[ChatEvent], None]] = []

    def subscribe(self, listener: Callable[[ChatEvent], None]) -> None:
        self._listeners.append(listener)

    def _emit(self, event: ChatEvent) -> None:
        for listener in list(self._listeners):
            listener(event)

    def get(self, conversation_id: str) -> Conversation:
        for c in self.conversations:
            if c.id == conversation_id:
                return c
        raise KeyError(f"no conversation {conversation_id}")

    @property
    def current(self) -> Conversation | None:
        return None if self.current_id is None else self.get(self.current_id)

    def newest_first(self) -> list[Conversation]:
        return sorted(self.conversations, key=lambda c: (c.updated, c.id), reverse=True)

    def new_conversation(self) -> Conversation:
        now = self._clock()
        conversation = Conversation(new_conversation_id(now), created=now, updated=now)
        if self.system_prompt:
            conversation.messages.append(Message("system", self.system_prompt))
        self.conversations.append(conversation)
        self._emit(ChatEvent(ChatEventKind.ADDED, conversation.id))
        self.select(conversation.id)
        return conversation

    def load(self, conversations: Sequence[Conversation]) -> None:
        """Add conversations read from disk (those already here are kept as they are)."""
        known = {c.id for c in self.conversations}
        self.conversations.extend(c for c in conversations if c.id not in known)
        self._emit(ChatEvent(ChatEventKind.LISTED))

    def rename(self, conversation_id: str, title: str) -> None:
        title = " ".join(title.split())
        if not title:
            raise ChatError("a chat's name cannot be empty")
        self.get(conversation_id).title = title[:200]
        self._emit(ChatEvent(ChatEventKind.RENAMED, conversation_id))

    def remove(self, conversation_id: str) -> None:
        """Forget a conversation (its file too, when kept); the newest other one becomes current,
        or a new one when none is left. Refused while it streams."""
        conversation = self.get(conversation_id)
        if conversation.streaming:
            raise ChatError("this chat is still receiving an answer; stop it first")
        self.conversations.remove(conversation)
        was_current = self.current_id == conversation_id
        if was_current:
            self.current_id = None
        self._emit(ChatEvent(ChatEventKind.REMOVED, conversation_id))
        if was_current:
            rest = self.newest_first()
            if rest:
                self.select(rest[0].id)
            else:
                self.new_conversation()

    def select(self, conversation_id: str) -> None:
        conversation = self.get(conversation_id)
        self.current_id = conversation_id
        if conversation.model in self.models:
            self.model_name = conversation.model
        self._emit(ChatEvent(ChatEventKind.SELECTED, conversation_id))

    def set_models(self, models: Sequence[str]) -> None:
        self.models = list(models)
        if self.model_name not in self.models:
            self.model_name = self.models[0] if self.models else None
        self._emit(ChatEvent(ChatEventKind.MODELS))

    def start_reply(self, conversation_id: str, text: str) -> list[dict[str, str]]:
        """Add the user's message and an empty assistant message; return the messages to send."""
        conversation = self.get(conversation_id)
        if conversation.streaming:
            raise ChatError("a reply is still streaming in this conversation; stop it or wait for it")
        if not text.strip():
            raise ChatError("type a message first")
        if conversation.title == NEW_TITLE:
            conversation.title = " ".join(text.split())[:TITLE_LENGTH]
        conversation.messages.append(Message("user", text))
        conversation.updated = self._clock()
        self._emit(ChatEvent(ChatEventKind.MESSAGE, conversation_id))
        return self._open_reply(conversation)

    def regenerate(self, conversation_id: str) -> list[dict[str, str]]:
        """Drop the last answer and open a new one to the same question; return the messages to send."""
        conversation = self.get(conversation_id)
        if not conversation.can_regenerate:
            raise ChatError("there is no finished answer to regenerate in this chat")
        conversation.messages.pop()
        return self._open_reply(conversation)

    def _open_reply(self, conversation: Conversation) -> list[dict[str, str]]:
        history = conversation.history()
        conversation.model = self.model_name
        conversation.messages.append(Message("assistant", state=STREAMING, throughput=Throughput()))
        self._emit(ChatEvent(ChatEventKind.MESSAGE, conversation.id))
        return history

    def add_delta(self, conversation_id: str, text: str, at: float, *, reasoning: bool = False) -> None:
        """Append streamed text (``at``: when it arrived, ``time.monotonic()``) to the answer, or to
        its reasoning (``reasoning``: a thinking model's ``reasoning_content``)."""
        reply = self._reply(conversation_id)
        if reply is None:
            return  # arrived after the reply was stopped
        if reasoning:
            reply.reasoning += text
        else:
            reply.content += text
        assert reply.throughput is not None
        reply.throughput.add(at)
        self._emit(ChatEvent(ChatEventKind.DELTA, conversation_id, text))

    def end_reply(self, conversation_id: str, state: str, *, error: str | None = None,
                  completion_tokens: int | None = None) -> None:
        reply = self._reply(conversation_id)
        if reply is None:
            return
        reply.state, reply.error = state, error
        self.get(conversation_id).updated = self._clock()
        if completion_tokens is not None and reply.throughput is not None:
            reply.throughput.tokens = completion_tokens
        self._emit(ChatEvent(ChatEventKind.ENDED, conversation_id))

    def _reply(self, conversation_id: str) -> Message | None:
        conversation = self.get(conversation_id)
        return conversation.messages[-1] if conversation.streaming else None


# -- the client (runs on the asyncio loop) ---------------------------------------------------------

@dataclass(frozen=True)
class ReplyResult:
    text: str
    finish_reason: str | None
    completion_tokens: int | None  # from the usage chunk; None if the server sent none


class ChatClient:
    """The fleet's OpenAI-compatible API at ``base_url`` (".../v1"); a session per call keeps it
    independent of which loop runs it."""

    def __init__(self, base_url: str, api_key: str | None = None, *, ca_pem: bytes | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.ca_pem = ca_pem  # the fleet CA: an https API (the service off loopback) must chain to it

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _session(self, total: float | None) -> aiohttp.ClientSession:
        timeout = aiohttp.ClientTimeout(total=total, connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
        connector = None
        if self.ca_pem is not None and self.base_url.startswith("https://"):
            from engine.api.guard import api_client_context
            from engine.trust.fleet_ca import Role
            from engine.trust.tls_peer import PeerCheckingConnector, expect_peer

            # the CA alone admits every member: the API must hold the service's (console-role) certificate
            expected = expect_peer(Role.FLEET_SERVICE, what=f"the fleet's API at {self.base_url}")
            connector = PeerCheckingConnector(expected, ssl=api_client_context(self.ca_pem))
        return aiohttp.ClientSession(timeout=timeout, headers=self._headers(), connector=connector)

    async def async_models(self) -> list[str]:
        """The model ids ``/v1/models`` lists."""
        async with self._session(MODELS_TIMEOUT_S) as session:
            doc = await self._json(session, "GET", "/models")
        try:
            return [str(m["id"]) for m in doc["data"]]
        except (KeyError, TypeError) as exc:
            raise ChatError(f"{self.base_url}/models did not answer with a model list; is this the fleet's "
                            "API address?") from exc

    async def async_complete(self, model: str, messages: Sequence[Mapping[str, str]], **options: Any) -> ReplyResult:
        """One answer, not streamed."""
        body = {"model": model, "messages": list(messages), "stream": False, **options}
        async with self._session(REPLY_TIMEOUT_S) as session:
            doc = await self._json(session, "POST", "/chat/completions", body)
        choice = doc["choices"][0]
        return ReplyResult(choice["message"]["content"] or "", choice.get("finish_reason"),
                           doc.get("usage", {}).get("completion_tokens"))

    async def async_stream(self, model: str, messages: Sequence[Mapping[str, str]],
                           **options: Any) -> AsyncIterator[dict[str, Any]]:
        """The answer's chunks as parsed JSON objects, ending before ``[DONE]``."""
        body = {"model": model, "messages": list(messages), "stream": True,
                "stream_options": {"include_usage": True}, **options}
        async with self._session(None) as session:
            try:
                async with session.post(f"{self.base_url}/chat/completions", json=body) as resp:
                    if resp.status != 200:
                        raise await self._refusal(resp)
                    async for raw in resp.content:
                        line = raw.decode("utf-8").strip()
                        if not line.startswith("data:"):
                            continue  # blank separators, comments, event names
                        data = line[5:].strip()
                        if data == "[DONE]":
                            return
                        chunk = json.loads(data)
                        if "error" in chunk:
                            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
                            code = error.get("code")
                            raise ChatError(f"the fleet stopped the answer: {error.get('message', chunk)}",
                                            code=code if isinstance(code, str) else None)
                        yield chunk
            except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, PeerIdentityError) as exc:
                raise self._unreachable(exc) from exc

    async def _json(self, session: aiohttp.ClientSession, method: str, path: str,
                    body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        try:
            async with session.request(method, f"{self.base_url}{path}", json=body) as resp:
                if resp.status != 200:
                    raise await self._refusal(resp)
                return await resp.json()
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, PeerIdentityError) as exc:
            raise self._unreachable(exc) from exc

    async def async_health(self) -> tuple[int, dict[str, Any]]:
        """The fleet's ``/health`` (beside ``/v1``; no key needed): its HTTP status (200 while a ring
        can serve, 503 when none can) and its JSON report, or ChatError when nothing answers."""
        root = self.base_url.removesuffix("/v1")
        async with self._session(MODELS_TIMEOUT_S) as session:
            try:
                async with session.get(f"{root}/health") as resp:
                    try:
                        doc = await resp.json(content_type=None)
                    except (json.JSONDecodeError, aiohttp.ContentTypeError, UnicodeDecodeError):
                        doc = None
                    if not isinstance(doc, dict):
                        raise ChatError(f"{root}/health answered {resp.status} without a health report; is "
                                        "this the fleet's API address?", status=resp.status)
                    return resp.status, doc
            except (aiohttp.ClientError, TimeoutError, PeerIdentityError) as exc:
                raise self._unreachable(exc) from exc

    async def _refusal(self, resp: aiohttp.ClientResponse) -> ChatError:
        code = None
        try:
            error = (await resp.json())["error"]
            message, code = error["message"], error.get("code")
        except (aiohttp.ClientError, ValueError, LookupError, TypeError, AttributeError):  # no OpenAI error body
            message = resp.reason or "no reason given"
        return ChatError(f"the fleet's API at {self.base_url} answered {resp.status}: {message}",
                         status=resp.status, code=code if isinstance(code, str) else None)

    def _unreachable(self, exc: BaseException) -> ChatError:
        if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
            return ChatError(f"the fleet's API at {self.base_url} stopped answering; try again, or ask the "
                             "admin whether the fleet is running", unreachable=True)
        return ChatError(f"cannot reach the fleet's API at {self.base_url} ({_why(exc)}); check that the fleet "
                         "is running and this PC can reach it", unreachable=True)


def _why(exc: BaseException) -> str:
    """A connection failure in a few words: "connection refused" rather than aiohttp's paragraph."""
    os_error = getattr(exc, "os_error", None) or (exc if isinstance(exc, OSError) else None)
    if isinstance(os_error, ConnectionRefusedError):
        return "connection refused: nothing listens there"
    if isinstance(os_error, OSError) and os_error.strerror:
        return os_error.strerror[0].lower() + os_error.strerror[1:]
    return str(exc) or type(exc).__name__


async def async_stream_reply(client: ChatClient, model: str, messages: Sequence[Mapping[str, str]],
                             on_delta: Callable[[str, float], None], *,
                             on_reasoning: Callable[[str, float], None] | None = None,
                             clock: Callable[[], float] = time.monotonic, **options: Any) -> ReplyResult:
    """Stream one answer, calling ``on_delta(text, arrived_at)`` for each non-empty delta of the
    answer and ``on_reasoning`` for each of a thinking model's reasoning (on the loop's thread).
    Cancel the task to stop: the connection closes and the fleet stops generating."""
    parts: list[str] = []
    finish: str | None = None
    tokens: int | None = None
    async for chunk in client.async_stream(model, messages, **options):
        if chunk.get("usage"):
            tokens = chunk["usage"].get("completion_tokens")
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            thought = delta.get("reasoning_content") or ""
            if thought and on_reasoning is not None:
                on_reasoning(thought, clock())
            text = delta.get("content") or ""
            if text:
                parts.append(text)
                on_delta(text, clock())
            finish = choice.get("finish_reason") or finish
    return ReplyResult("".join(parts), finish, tokens)
