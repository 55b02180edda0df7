"""The hand-over between the API's generate and shape stages (engine.api.generate -> engine.api.openai_answer):
a choice's typed events in, its deltas out; a stop string closes the event stream, which is what
cancels the choice's generation, and the End event carries the finish and stop reasons."""

from __future__ import annotations

import asyncio

from engine.api.generate import End, Token
from engine.api.openai_answer import ChoiceBuilder, choice_deltas
from engine.api.share import BUDGET_STOP
from engine.generation.request import TokenEvent
from tests.support.api_helpers import ByteTokenizer


def run(text: bytes, end: End, stop: tuple[str, ...] = ()) -> tuple[list[dict], list[int], bool]:
    """The choice's deltas for ``text``'s bytes then ``end``; the tokens the stream handed on; whether it was closed."""
    handed, closed = [], []

    async def events():
        try:
            for i, token in enumerate(text):
                handed.append(token)
                yield Token(TokenEvent(token, i))
            yield end
        finally:
            closed.append(True)

    async def collect() -> list[dict]:
        builder = ChoiceBuilder(0, "text", ByteTokenizer().decode, stop)
        return [d async for deltas in choice_deltas(events(), builder) for d in deltas]

    return asyncio.run(collect()), handed, bool(closed)


def test_a_stop_string_closes_the_choices_event_stream_there():
    deltas, handed, closed = run(b"hello world", End("length"), stop=("lo",))
    assert "".join(d["text"] for d in deltas) == "hel" and deltas[-1]["finish_reason"] == "stop"
    assert handed == list(b"hello") and closed  # nothing asked past the stop: the generation is cancelled


def test_the_end_event_closes_the_choice_with_its_reasons():
    deltas, handed, closed = run(b"abc", End(*BUDGET_STOP))
    assert "".join(d["text"] for d in deltas) == "abc" and handed == list(b"abc") and closed
    assert deltas[-1]["finish_reason"] == "length" and deltas[-1]["stop_reason"] == "token_budget"
    deltas, _, _ = run(b"abc", End("stop"))
    assert deltas[-1]["finish_reason"] == "stop" and "stop_reason" not in deltas[-1]
