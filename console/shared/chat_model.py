"""Chat with the fleet, without Qt: conversations and messages, the streaming client for the
fleet's OpenAI-compatible API, and the tokens-per-second meter.

Two halves that never share a thread. :class:`ChatModel` holds the conversations and tells its
listeners what changed; it is mutated from one thread only (the GUI's, in the chat window).
:func:`async_stream_reply` runs on an asyncio loop, reads the server-sent events of
``/v1/chat/completions`` and hands each text delta to a callback, which the window forwards to
the model on the GUI thread. Stopping a reply is cancelling that coroutine: leaving the
``async with`` closes the HTTP response, and the server cancels the generation when its client
goes away.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
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
    in the middle of a streamed answer; the message says which and what to do."""


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


@dataclass
class Conversation:
    id: int
    title: str = "New chat"
    messages: list[Message] = field(default_factory=list)

    @property
    def streaming(self) -> bool:
        return bool(self.messages) and self.messages[-1].state == STREAMING

    def history(self) -> list[dict[str, str]]:
        """The messages to send as context: failed replies and empty stopped ones are left out."""
        return [{"role": m.role, "content": m.content} for m in self.messages
                if m.state in (DONE, STOPPED) and (m.content or m.role == "user")]


@dataclass(frozen=True)
class ChatEvent:
    """What changed: ``kind`` is one of "added", "selected", "message", "delta", "ended", "models"."""

    kind: str
    conversation_id: int | None = None
    text: str = ""


class ChatModel:
    """The conversations, the current one, the models on offer. Single-threaded: see the module doc."""

    def __init__(self, system_prompt: str | None = None) -> None:
        self.system_prompt = system_prompt
        self.conversations: list[Conversation] = []
        self.current_id: int | None = None
        self.models: list[str] = []
        self.model_name: str | None = None
        self._next_id = 1
        self._listeners: list[Callable[[ChatEvent], None]] = []

    def subscribe(self, listener: Callable[[ChatEvent], None]) -> None:
        self._listeners.append(listener)

    def _emit(self, event: ChatEvent) -> None:
        for listener in list(self._listeners):
            listener(event)

    def get(self, conversation_id: int) -> Conversation:
        for c in self.conversations:
            if c.id == conversation_id:
                return c
        raise KeyError(f"no conversation {conversation_id}")

    @property
    def current(self) -> Conversation | None:
        return None if self.current_id is None else self.get(self.current_id)

    def new_conversation(self) -> Conversation:
        conversation = Conversation(self._next_id)
        if self.system_prompt:
            conversation.messages.append(Message("system", self.system_prompt))
        self._next_id += 1
        self.conversations.append(conversation)
        self._emit(ChatEvent("added", conversation.id))
        self.select(conversation.id)
        return conversation

    def select(self, conversation_id: int) -> None:
        self.get(conversation_id)
        self.current_id = conversation_id
        self._emit(ChatEvent("selected", conversation_id))

    def set_models(self, models: Sequence[str]) -> None:
        self.models = list(models)
        if self.model_name not in self.models:
            self.model_name = self.models[0] if self.models else None
        self._emit(ChatEvent("models"))

    def start_reply(self, conversation_id: int, text: str) -> list[dict[str, str]]:
        """Add the user's message and an empty assistant message; return the messages to send."""
        conversation = self.get(conversation_id)
        if conversation.streaming:
            raise ChatError("a reply is still streaming in this conversation; stop it or wait for it")
        if not text.strip():
            raise ChatError("type a message first")
        if conversation.title == "New chat":
            conversation.title = " ".join(text.split())[:40]
        conversation.messages.append(Message("user", text))
        self._emit(ChatEvent("message", conversation_id))
        history = conversation.history()
        conversation.messages.append(Message("assistant", state=STREAMING, throughput=Throughput()))
        self._emit(ChatEvent("message", conversation_id))
        return history

    def add_delta(self, conversation_id: int, text: str, at: float) -> None:
        """Append streamed text (``at``: when it arrived, ``time.monotonic()``)."""
        reply = self._reply(conversation_id)
        if reply is None:
            return  # arrived after the reply was stopped
        reply.content += text
        assert reply.throughput is not None
        reply.throughput.add(at)
        self._emit(ChatEvent("delta", conversation_id, text))

    def end_reply(self, conversation_id: int, state: str, *, error: str | None = None,
                  completion_tokens: int | None = None) -> None:
        reply = self._reply(conversation_id)
        if reply is None:
            return
        reply.state, reply.error = state, error
        if completion_tokens is not None and reply.throughput is not None:
            reply.throughput.tokens = completion_tokens
        self._emit(ChatEvent("ended", conversation_id))

    def _reply(self, conversation_id: int) -> Message | None:
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
            connector = PeerCheckingConnector(expect_peer(Role.CONSOLE, what=f"the fleet's API at {self.base_url}"),
                                              ssl=api_client_context(self.ca_pem))
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
                        raise ChatError(await self._refusal(resp))
                    async for raw in resp.content:
                        line = raw.decode("utf-8").strip()
                        if not line.startswith("data:"):
                            continue  # blank separators, comments, event names
                        data = line[5:].strip()
                        if data == "[DONE]":
                            return
                        chunk = json.loads(data)
                        if "error" in chunk:
                            raise ChatError(f"the fleet stopped the answer: {chunk['error'].get('message', chunk)}")
                        yield chunk
            except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, PeerIdentityError) as exc:
                raise self._unreachable(exc) from exc

    async def _json(self, session: aiohttp.ClientSession, method: str, path: str,
                    body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        try:
            async with session.request(method, f"{self.base_url}{path}", json=body) as resp:
                if resp.status != 200:
                    raise ChatError(await self._refusal(resp))
                return await resp.json()
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, PeerIdentityError) as exc:
            raise self._unreachable(exc) from exc

    async def _refusal(self, resp: aiohttp.ClientResponse) -> str:
        try:
            message = (await resp.json())["error"]["message"]
        except Exception:
            message = resp.reason or "no reason given"
        return f"the fleet's API at {self.base_url} answered {resp.status}: {message}"

    def _unreachable(self, exc: BaseException) -> ChatError:
        if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
            return ChatError(f"the fleet's API at {self.base_url} stopped answering; try again, or ask the "
                             "admin whether the fleet is running")
        return ChatError(f"cannot reach the fleet's API at {self.base_url} ({exc}); check that the fleet "
                         "is running and this PC can reach it")


async def async_stream_reply(client: ChatClient, model: str, messages: Sequence[Mapping[str, str]],
                             on_delta: Callable[[str, float], None], *,
                             clock: Callable[[], float] = time.monotonic, **options: Any) -> ReplyResult:
    """Stream one answer, calling ``on_delta(text, arrived_at)`` for each non-empty delta (on the
    loop's thread). Cancel the task to stop: the connection closes and the fleet stops generating."""
    parts: list[str] = []
    finish: str | None = None
    tokens: int | None = None
    async for chunk in client.async_stream(model, messages, **options):
        if chunk.get("usage"):
            tokens = chunk["usage"].get("completion_tokens")
        for choice in chunk.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") or ""
            if text:
                parts.append(text)
                on_delta(text, clock())
            finish = choice.get("finish_reason") or finish
    return ReplyResult("".join(parts), finish, tokens)
