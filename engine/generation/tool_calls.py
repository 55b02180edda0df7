"""Tool (function) calling as text, pure: what the model is told, and what its answer means.

A model's chat template may take ``tools`` itself (:attr:`ChatTokenizer.takes_tools`); most
small ones do not (neither SmolLM2's nor the tiny test models'). For those the functions are
described in a system block in a generic format, the Hermes/Qwen one that many instruction
models were trained on::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call the model made earlier is written back into its assistant turn in that format, and a
tool's result goes back as a user turn in a ``<tool_response>`` block, so a template that knows
only system/user/assistant renders the whole round trip. The model's output is parsed for the
same blocks by :class:`ToolCallStream`, incrementally (streamed answers) or all at once
(:func:`parse_tool_calls`); a block that is not a well-formed call stays text, as does a call of a
function the request did not declare (a prompt-injected model cannot invent a tool), and a block
nested too deeply to read (JSON deeper than Python's recursion limit) is not a call either.
"""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.generation.markers import partial_marker_len
from engine.generation.request import FunctionSchema, ToolCallConstraint

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
ARGUMENT_FRAGMENT = 32  # characters of arguments per streamed delta
EMPTY_PARAMETERS = '{"type":"object","properties":{}}'


def compact_json(value: Any) -> str:
    """JSON without spaces, keys in the client's order: a schema's property order is the order the
    constrained answer writes them in (as OpenAI's), and the order the model reads them in."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class FunctionTool:
    """One entry of a request's ``tools``; ``parameters`` is the arguments' JSON Schema as compact JSON."""

    name: str
    description: str = ""
    parameters: str = EMPTY_PARAMETERS
    strict: bool = False

    def to_json(self) -> dict[str, Any]:
        """The OpenAI form, as a chat template that takes ``tools`` expects it."""
        function: dict[str, Any] = {"name": self.name, "parameters": json.loads(self.parameters)}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolMode(enum.Enum):
    AUTO = "auto"  # the model decides; its calls are parsed out of its text
    NONE = "none"  # no calls: the tools are not shown and the text is not parsed
    REQUIRED = "required"  # it must call one of the tools
    FUNCTION = "function"  # it must call the named one


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolMode = ToolMode.AUTO
    name: str | None = None  # the function, for ToolMode.FUNCTION

    @property
    def forced(self) -> bool:
        return self.mode in (ToolMode.REQUIRED, ToolMode.FUNCTION)


@dataclass(frozen=True)
class ToolCall:
    """A call the model made; ``arguments`` is JSON text (as the OpenAI API carries it)."""

    id: str
    name: str
    arguments: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_constraint(tools: Sequence[FunctionTool], choice: ToolChoice) -> ToolCallConstraint | None:
    """The grammar a forced call must match (None under auto/none): one call of the named function,
    or of any of ``tools`` for ``required``, in this module's text format."""
    if not choice.forced:
        return None
    chosen = [t for t in tools if choice.mode is ToolMode.REQUIRED or t.name == choice.name]
    return ToolCallConstraint(tuple(FunctionSchema(t.name, t.parameters) for t in chosen),
                              opening=CALL_OPEN + "\n", closing="\n" + CALL_CLOSE)


# -- what the model is told --------------------------------------------------------------------

def system_block(tools: Sequence[FunctionTool], choice: ToolChoice) -> str:
    """The generic description of ``tools`` for a template that does not take them."""
    lines = ["You can call functions. The functions you may call, as JSON signatures:", "<tools>"]
    lines += [compact_json(t.to_json()) for t in tools]
    lines += ["</tools>", "To call a function, answer with one block per call, each exactly like this:",
              f'{CALL_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CALL_CLOSE}']
    if choice.mode is ToolMode.REQUIRED:
        lines.append("You must call at least one of the functions.")
    elif choice.mode is ToolMode.FUNCTION:
        lines.append(f"You must call the function {choice.name!r}.")
    else:
        lines.append("Call a function only when it helps; otherwise answer in plain text.")
    return "\n".join(lines)


def loads_or_text(arguments: str) -> Any:
    """An earlier call's arguments as JSON, or the text itself when it is not JSON (or nests too
    deeply to read: the API refuses those first, see ``openai_schema._earlier_calls``)."""
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments


def call_text(name: str, arguments: str) -> str:
    """A call in the generic format (how an earlier call goes back into the conversation)."""
    args = loads_or_text(arguments)
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CALL_CLOSE}"


def _native_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as HF chat templates that take tools expect it (arguments as objects)."""
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            args = loads_or_text(call.arguments)
            calls.append({"id": call.id, "type": "function", "function": {"name": call.name, "arguments": args}})
        out["tool_calls"] = calls
    return out


def _generic_message(message: Mapping[str, Any]) -> dict[str, str]:
    """A message in system/user/assistant terms only: calls as text, tool results as user turns
    (an assistant's ``reasoning_content`` kept)."""
    role, content = message["role"], message.get("content") or ""
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls") or ()
    if calls:
        content = "\n".join([content, *(call_text(c.name, c.arguments) for c in calls)] if content else
                            [call_text(c.name, c.arguments) for c in calls])
    out = {"role": role, "content": content}
    if message.get("reasoning_content"):  # a thinking model's earlier reasoning, for templates that read it
        out["reasoning_content"] = message["reasoning_content"]
    return out


def conversation(messages: Sequence[Mapping[str, Any]], tools: Sequence[FunctionTool], choice: ToolChoice,
                 native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)`` to render: for a template that takes tools (``native``) the messages
    with their calls and the tools in OpenAI form; else the generic format (the tools described in
    the first system message, or a new one) and None. Under ``none`` the tools are not shown."""
    shown = list(tools) if tools and choice.mode is not ToolMode.NONE else []
    if native:
        return [_native_message(m) for m in messages], [t.to_json() for t in shown] or None
    out = [_generic_message(m) for m in messages]
    if shown:
        block = system_block(shown, choice)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


# -- what the answer means -----------------------------------------------------------------------

@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    """The first delta of a call: its index among the answer's calls, id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    fragment: str


Piece = ContentDelta | CallStart | ArgumentsDelta


def _as_call(block: str, declared: Collection[str] | None) -> tuple[str, str] | None:
    """(name, arguments JSON) of a block's body, or None when it is not a well-formed call of a
    function in ``declared`` (None: any name)."""
    try:
        body = json.loads(block)
        if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
            return None
        if declared is not None and body["name"] not in declared:
            return None
        args = body.get("arguments", body.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string, as the API does
            args = json.loads(args)
        if not isinstance(args, dict):
            return None
        return body["name"], json.dumps(args, ensure_ascii=False)
    except (ValueError, RecursionError):  # not JSON, or nested past the recursion limit
        return None


class ToolCallStream:
    """Split generated text into content and tool calls, delta by delta.

    Content is passed on as it comes, except a tail that could be the start of ``<tool_call>``;
    a call's block is held until its ``</tool_call>``, then given as a :class:`CallStart` and
    :class:`ArgumentsDelta` fragments. A block that is not a well-formed call of a function in
    ``declared`` (None: any name) is given back as content, as is an unclosed one at :meth:`finish`.
    """

    def __init__(self, declared: Collection[str] | None = None) -> None:
        self._declared = frozenset(declared) if declared is not None else None
        self._pending = ""  # text not yet given out: a possible opening tag, or an open block
        self._in_call = False
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> list[Piece]:
        self._pending += text
        out: list[Piece] = []
        while True:
            if self._in_call:
                end = self._pending.find(CALL_CLOSE)
                if end < 0:
                    return out
                block, self._pending = self._pending[:end], self._pending[end + len(CALL_CLOSE):]
                self._in_call = False
                out += self._call(block)
                continue
            start = self._pending.find(CALL_OPEN)
            if start >= 0:
                if start:
                    out.append(ContentDelta(self._pending[:start]))
                self._pending = self._pending[start + len(CALL_OPEN):]
                self._in_call = True
                continue
            keep = partial_marker_len(self._pending, (CALL_OPEN,))
            ready, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
            if ready:
                out.append(ContentDelta(ready))
            return out

    def finish(self) -> list[Piece]:
        """The held text once generation has ended (an unclosed block is content)."""
        text = (CALL_OPEN if self._in_call else "") + self._pending
        self._pending, self._in_call = "", False
        return [ContentDelta(text)] if text else []

    def _call(self, block: str) -> list[Piece]:
        parsed = _as_call(block, self._declared)
        if parsed is None:
            return [ContentDelta(CALL_OPEN + block + CALL_CLOSE)]
        name, arguments = parsed
        call = ToolCall(new_call_id(), name, arguments)
        index = len(self.calls)
        self.calls.append(call)
        return [CallStart(index, call.id, name), *(ArgumentsDelta(index, arguments[i:i + ARGUMENT_FRAGMENT])
                                                   for i in range(0, len(arguments), ARGUMENT_FRAGMENT))]


def parse_tool_calls(text: str, declared: Collection[str] | None = None) -> tuple[str | None, tuple[ToolCall, ...]]:
    """A whole answer's content (None when only calls and white space) and its calls of functions in
    ``declared`` (None: any), in order."""
    stream = ToolCallStream(declared)
    pieces = [*stream.push(text), *stream.finish()]
    content = "".join(p.text for p in pieces if isinstance(p, ContentDelta))
    calls = tuple(stream.calls)
    if calls:
        return content.strip() or None, calls
    return content, calls
