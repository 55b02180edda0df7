"""Stage 4 of a /v1/responses request, shape: the chat answer's choice in, a Response object out —
whole, or as the typed server-sent events the ``openai`` package parses.

Output items, in the order a model writes them: a ``reasoning`` item (a thinking model's thoughts),
a ``message`` with one ``output_text`` part (when the answer has text beside or instead of calls),
then a ``function_call`` item per call (``call_id`` is the call's id, which a follow-up's
``function_call_output`` names). A streamed response sends ``response.created`` and
``response.in_progress``, then per item ``response.output_item.added``, its deltas
(``response.reasoning_text.delta``, ``response.content_part.added`` + ``response.output_text.delta``,
``response.function_call_arguments.delta``), their ``.done`` events and ``response.output_item.done``,
and last ``response.completed`` (or ``response.incomplete`` when ``max_output_tokens`` or the key's
token budget ended it) holding the whole response; each event carries its ``sequence_number``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Mapping
from typing import Any

from engine.api.api_error import ApiError
from engine.api.responses_schema import ResponseParams


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


class ResponseShape:
    """The Response object of one request (``response_id``) and its stream of events."""

    def __init__(self, params: ResponseParams, model: str, response_id: str | None = None) -> None:
        self.params, self.model = params, model
        self.id = response_id or new_response_id()
        self.created_at = int(time.time())
        self._seq = 0

    # -- the whole response ------------------------------------------------------------------------

    def response(self, output: list[dict[str, Any]], status: str = "completed",
                 usage: Mapping[str, int] | None = None) -> dict[str, Any]:
        p = self.params
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": p.instructions, "metadata": dict(p.metadata), "parallel_tool_calls": True,
            "previous_response_id": p.previous_response_id, "store": p.store,
            "temperature": p.chat.sampling.temperature, "top_p": p.chat.sampling.top_p,
            "max_output_tokens": p.max_output_tokens, "tool_choice": p.tool_choice, "tools": list(p.tools),
            "text": {"format": dict(p.text_format)},
            "reasoning": {"effort": p.chat.reasoning_effort.value if p.chat.reasoning_effort else None,
                          "summary": None},
            "usage": None if usage is None else _usage(usage),
        }

    def output_of(self, choice: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The output items of a chat choice (``message``: content, tool_calls, reasoning_content)."""
        message = choice["message"]
        items: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            items.append(self._reasoning(message["reasoning_content"]))
        if message.get("content"):
            items.append(self._message(message["content"]))
        for k, call in enumerate(message.get("tool_calls") or ()):
            items.append(self._call(k, call["id"], call["function"]["name"], call["function"]["arguments"]))
        return items

    @staticmethod
    def status_of(choice: Mapping[str, Any]) -> str:
        return "incomplete" if choice.get("finish_reason") == "length" else "completed"

    def whole(self, choice: Mapping[str, Any], usage: Mapping[str, int]) -> dict[str, Any]:
        return self.response(self.output_of(choice), self.status_of(choice), usage)

    def _reasoning(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "reasoning", "id": f"rs_{self.id[5:]}", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}

    def _message(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": f"msg_{self.id[5:]}", "status": status, "role": "assistant",
                "content": [_text_part(text)] if status == "completed" else []}

    def _call(self, k: int, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{self.id[5:]}_{k}", "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

    # -- the stream --------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

    async def events(self, deltas: AsyncIterable[list[dict[str, Any]]],
                     ending: Callable[[], tuple[Mapping[str, Any], Mapping[str, int]]]) -> AsyncGenerator[bytes, None]:
        """The typed events for the chat ``deltas`` of one choice; ``ending()`` gives the whole choice
        and the usage once the deltas are done."""
        yield self._event("response.created", response=self.response([], "in_progress"))
        yield self._event("response.in_progress", response=self.response([], "in_progress"))
        items = _ItemStream(self)
        async for ready in deltas:
            for delta in ready:
                for chunk in items.push(delta.get("delta") or {}):
                    yield chunk
        for chunk in items.close():
            yield chunk
        choice, usage = ending()
        status = self.status_of(choice)
        yield self._event(f"response.{status}", response=self.response(items.done, status, usage))


class _ItemStream:
    """The open output item of a stream and the events that open, grow and close items."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.done: list[dict[str, Any]] = []
        self._open: str | None = None  # "reasoning" | "message" | "call"
        self._text = ""
        self._pending_text = ""  # text before the message opens (whitespace before a call is not a message)
        self._call: dict[str, Any] | None = None
        self._calls = 0

    @property
    def _index(self) -> int:
        return len(self.done)

    def push(self, delta: Mapping[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            if self._open != "reasoning":
                out += self.close()
                out += self._open_item("reasoning", self.shape._reasoning("", "in_progress"))
            self._text += delta["reasoning_content"]
            out.append(self.shape._event("response.reasoning_text.delta", item_id=self._item_id(), content_index=0,
                                         output_index=self._index, delta=delta["reasoning_content"]))
        if delta.get("content"):
            out += self._content(delta["content"])
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("id"):
                out += self.close()
                self._call = self.shape._call(self._calls, call["id"], function.get("name", ""), "", "in_progress")
                self._calls += 1
                out += self._open_item("call", dict(self._call))
            if function.get("arguments") and self._call is not None:
                self._call["arguments"] += function["arguments"]
                out.append(self.shape._event("response.function_call_arguments.delta", item_id=self._call["id"],
                                             output_index=self._index, delta=function["arguments"]))
        return out

    def _content(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self._open != "message":
            self._pending_text += text
            if not self._pending_text.strip():
                return out
            out += self.close()
            out += self._open_item("message", self.shape._message("", "in_progress"))
            out.append(self.shape._event("response.content_part.added", item_id=self._item_id(),
                                         output_index=self._index, content_index=0, part=_text_part("")))
            text, self._pending_text = self._pending_text, ""
        self._text += text
        out.append(self.shape._event("response.output_text.delta", item_id=self._item_id(), output_index=self._index,
                                     content_index=0, delta=text, logprobs=[]))
        return out

    def _item_id(self) -> str:
        prefix = {"reasoning": "rs", "message": "msg"}[self._open or "message"]
        return f"{prefix}_{self.shape.id[5:]}"

    def _open_item(self, kind: str, item: dict[str, Any]) -> list[bytes]:
        self._open, self._text = kind, ""
        return [self.shape._event("response.output_item.added", output_index=self._index, item=item)]

    def close(self) -> list[bytes]:
        """Close the open item (its .done events), if any."""
        if self._open is None:
            return []
        s, i, out = self.shape, self._index, []
        if self._open == "reasoning":
            item = s._reasoning(self._text)
            out.append(s._event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                                text=self._text))
        elif self._open == "message":
            item = s._message(self._text)
            out.append(s._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                text=self._text, logprobs=[]))
            out.append(s._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                                part=_text_part(self._text)))
        else:
            assert self._call is not None
            item = {**self._call, "status": "completed"}
            out.append(s._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                name=item["name"], arguments=item["arguments"]))
        out.append(s._event("response.output_item.done", output_index=i, item=item))
        self.done.append(item)
        self._open, self._text, self._call = None, "", None
        return out


def error_event(error: ApiError) -> bytes:
    """A failure after the stream began, as the Responses ``error`` event."""
    payload = {"type": "error", **error.body()["error"]}
    return f"event: error\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: Mapping[str, int]) -> dict[str, Any]:
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}
