"""Thinking models: the thinking block of an answer split from the answer, as pure code.

A model that thinks writes its reasoning between two markers before the answer
(``<think>…</think>``: Qwen3, QwQ, DeepSeek-R1, SmolLM3). The API returns the reasoning in
``reasoning_content`` and the rest in ``content``, as Open WebUI, LangChain and the ``openai``
client read it. Which markers a model uses is read from its chat template (:data:`MARKERS`, a
table: a family with other markers is a row). Some templates open the block themselves at the end
of the prompt (the answer then starts inside it): :func:`opens_thinking` tells from the prompt.

``reasoning_effort`` switches thinking through the template's own variables, where it has them:
``enable_thinking`` (Qwen3's switch; off for "none" and "minimal", on otherwise) and
``reasoning_effort`` itself (given as is). A template with neither ignores it.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass

from engine.generation.markers import partial_marker_len


@dataclass(frozen=True)
class ThinkingMarkers:
    """The text that opens and closes a model's thinking block."""

    open: str
    close: str


MARKERS = (ThinkingMarkers("<think>", "</think>"),)


class ReasoningEffort(enum.Enum):
    """The OpenAI request's ``reasoning_effort``."""

    NONE = "none"
    MINIMAL = "minimal"
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"

    @property
    def thinks(self) -> bool:
        return self not in (ReasoningEffort.NONE, ReasoningEffort.MINIMAL)


def markers_for(template: str | None) -> ThinkingMarkers | None:
    """The thinking markers a chat template writes, or None for a model that does not think."""
    if not template:
        return None
    return next((m for m in MARKERS if m.open in template and m.close in template), None)


def template_switches(effort: ReasoningEffort | None, variables: Collection[str]) -> dict[str, object]:
    """The template variables that carry ``effort`` (only those the template reads)."""
    if effort is None:
        return {}
    switches: dict[str, object] = {}
    if "enable_thinking" in variables:
        switches["enable_thinking"] = effort.thinks
    if "reasoning_effort" in variables:
        switches["reasoning_effort"] = effort.value
    return switches


def opens_thinking(prompt_tail: str, markers: ThinkingMarkers) -> bool:
    """Whether a prompt ending in ``prompt_tail`` leaves a thinking block open for the answer."""
    return prompt_tail.rfind(markers.open) > prompt_tail.rfind(markers.close)


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of the thinking block."""

    text: str


@dataclass(frozen=True)
class AnswerDelta:
    """A piece of the answer after (or without) the thinking block."""

    text: str


class _Phase(enum.Enum):
    START = "start"  # nothing but white space yet: the block may still open
    THINKING = "thinking"
    AFTER = "after"  # the block closed: white space before the answer is dropped
    ANSWER = "answer"


class ReasoningSplitter:
    """Split streamed answer text into :class:`ReasoningDelta` and :class:`AnswerDelta` pieces.

    The block counts only at the start of the answer (after white space), or from the first
    character when the prompt opened it (``opened``). Text that could be the start of a marker
    is held until it is known not to be; the blank lines around the reasoning are dropped. An
    answer cut off while thinking (``max_tokens``) is all reasoning.
    """

    def __init__(self, markers: ThinkingMarkers, opened: bool = False):
        self._markers = markers
        self._phase = _Phase.THINKING if opened else _Phase.START
        self._held = ""
        self._started_reasoning = False  # a reasoning piece was sent (leading newlines dropped before it)
        self.reasoning = ""  # all reasoning sent
        self.answer = ""  # all answer text sent

    def push(self, text: str) -> list[ReasoningDelta | AnswerDelta]:
        self._held += text
        return self._advance(final=False)

    def finish(self) -> list[ReasoningDelta | AnswerDelta]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[ReasoningDelta | AnswerDelta]:
        out: list[ReasoningDelta | AnswerDelta] = []
        while True:
            before = (self._phase, len(self._held))
            if self._phase is _Phase.START:
                self._start(final)
            if self._phase is _Phase.THINKING:
                self._think(final, out)
            if self._phase is _Phase.AFTER:
                stripped = self._held.lstrip()
                if stripped or final:
                    self._held, self._phase = stripped, _Phase.ANSWER
            if self._phase is _Phase.ANSWER and self._held:
                self._emit_answer(self._held, out)
                self._held = ""
            if (self._phase, len(self._held)) == before:
                return out

    def _start(self, final: bool) -> None:
        stripped = self._held.lstrip()
        opener = self._markers.open
        if stripped.startswith(opener):
            self._held, self._phase = stripped[len(opener):], _Phase.THINKING
        elif final or (stripped and not opener.startswith(stripped)):
            self._phase = _Phase.ANSWER  # no thinking block: everything held is the answer

    def _think(self, final: bool, out: list[ReasoningDelta | AnswerDelta]) -> None:
        closer = self._markers.close
        if not self._started_reasoning:
            self._held = self._held.lstrip("\n")
        end = self._held.find(closer)
        if end >= 0:
            self._emit_reasoning(self._held[:end].rstrip("\n"), out)
            self._held, self._phase = self._held[end + len(closer):], _Phase.AFTER
            return
        if final:
            self._emit_reasoning(self._held.rstrip("\n"), out)
            self._held = ""
            return
        keep = partial_marker_len(self._held, (closer,))
        ready = self._held[:len(self._held) - keep]
        body = ready.rstrip("\n")  # newlines just before the closing marker are not reasoning
        self._emit_reasoning(body, out)
        self._held = ready[len(body):] + self._held[len(ready):]

    def _emit_reasoning(self, text: str, out: list[ReasoningDelta | AnswerDelta]) -> None:
        if text:
            self._started_reasoning = True
            self.reasoning += text
            out.append(ReasoningDelta(text))

    def _emit_answer(self, text: str, out: list[ReasoningDelta | AnswerDelta]) -> None:
        self.answer += text
        out.append(AnswerDelta(text))
