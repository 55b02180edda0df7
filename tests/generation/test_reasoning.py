"""Thinking models: the thinking block split from the answer (pure), and the template's switches."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.generation.reasoning import (
    AnswerDelta,
    ReasoningDelta,
    ReasoningEffort,
    ReasoningSplitter,
    ThinkingMarkers,
    markers_for,
    opens_thinking,
    template_switches,
)
from engine.generation.tokenizer import ChatTokenizer
from tests.support.tiny_models import build_tiny_tokenizer

THINK = ThinkingMarkers("<think>", "</think>")
# The parts of Qwen3's template that matter here: the thinking switch, an empty block when it is
# off, and the earlier answers' reasoning dropped from the history.
QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n"
    "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def split(text_pieces, opened=False) -> tuple[str, str, list]:
    splitter = ReasoningSplitter(THINK, opened=opened)
    pieces = [p for t in text_pieces for p in splitter.push(t)] + splitter.finish()
    reasoning = "".join(p.text for p in pieces if isinstance(p, ReasoningDelta))
    answer = "".join(p.text for p in pieces if isinstance(p, AnswerDelta))
    assert (reasoning, answer) == (splitter.reasoning, splitter.answer)
    return reasoning, answer, pieces


@pytest.mark.parametrize("text, opened, reasoning, answer", [
    ("<think>\nFrance's capital.\n</think>\n\nParis.", False, "France's capital.", "Paris."),
    ("  \n<think>a < b</think>b is larger.", False, "a < b", "b is larger."),
    ("\nFrance's capital.\n</think>\n\nParis.", True, "France's capital.", "Paris."),  # the prompt opened it
    ("Paris. <think>no</think>", False, "", "Paris. <think>no</think>"),  # not at the start: text
    ("<think>\nStill thinking when max_tokens", False, "Still thinking when max_tokens", ""),
    ("<thi", False, "", "<thi"),  # ended inside what could have been the marker
    ("<think>\n\n</think>\n\nParis.", False, "", "Paris."),  # an empty block (thinking switched off)
    ("", False, "", ""),
])
def test_the_thinking_block_is_split_from_the_answer(text, opened, reasoning, answer):
    assert split([text], opened)[:2] == (reasoning, answer)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([
    "<think>\nStep 1: 2 + 2.\nStep 2: four.\n</think>\n\nIt is 4.",
    "<think>x</thi</think>answer </think> stays",
    "plain answer with </think> inside",
    "\n\n<think>\n\n\nlines\n\n\n</think>\n\n\nend\n",
]), st.lists(st.integers(0, 60), max_size=8))
def test_any_streamed_split_gives_the_same_parts(text, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    whole = split([text])
    streamed = split(chunks)
    assert streamed[:2] == whole[:2]
    assert all(p.text for p in streamed[2])  # no empty pieces


def test_markers_switches_and_an_opened_block_are_read_from_the_template():
    assert markers_for(QWEN3_LIKE) == THINK and markers_for("{{ messages }}") is None and markers_for(None) is None
    assert template_switches(ReasoningEffort.NONE, {"enable_thinking"}) == {"enable_thinking": False}
    assert template_switches(ReasoningEffort.HIGH, {"enable_thinking", "reasoning_effort"}) == {
        "enable_thinking": True, "reasoning_effort": "high"}
    assert template_switches(ReasoningEffort.LOW, {"tools"}) == {}  # a template without a switch ignores it
    assert template_switches(None, {"enable_thinking"}) == {}
    assert opens_thinking("<|im_start|>assistant\n<think>\n", THINK)
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
    assert not opens_thinking("<|im_start|>assistant\n", THINK)


def test_a_chat_tokenizer_with_a_thinking_template_takes_the_switch(tmp_path):
    root = build_tiny_tokenizer(tmp_path / "tok")
    config = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN3_LIKE}))
    tokenizer = ChatTokenizer(root)
    assert tokenizer.thinking == THINK and "enable_thinking" in tokenizer.template_variables
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
               {"role": "user", "content": "2+2?"}]
    on = tokenizer.render_chat(history)
    off = tokenizer.render_chat(history, switches={"enable_thinking": False})
    assert on.endswith("<|im_start|>assistant\n") and off.endswith("<think>\n\n</think>\n\n")
    assert "<think>\ngreet back\n</think>" in on
    assert tokenizer.decode(tokenizer.encode_chat(history, switches={"enable_thinking": False}),
                            skip_special_tokens=False).endswith("</think>\n\n")
