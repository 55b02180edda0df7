"""The embedded default model, end to end (slow: converts and exports SmolLM2-135M)."""

from __future__ import annotations

import pytest

from engine.generation.in_process import greedy_generate
from engine.generation.tokenizer import ChatTokenizer
from engine.shards.manifest import load_manifest
from engine.shards.stage import LocalChain

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_two_int4_stages_answer_paris(default_export_int4):
    manifest = load_manifest(default_export_int4)
    assert [(s.first_layer, s.last_layer) for s in manifest.stages] == [(0, 14), (15, 29)]
    assert manifest.weights.format == "int4" and manifest.weights.group_size == 64
    tokenizer = ChatTokenizer(default_export_int4 / "tokenizer")
    chain = LocalChain.load(default_export_int4)
    assert [s.fused_attention_count() for s in chain.stages] == [15, 15]
    result = greedy_generate(chain, tokenizer.encode_chat(QUESTION), 48, eos_ids=manifest.model.eos_token_ids)
    answer = tokenizer.decode(result.tokens)
    assert "Paris" in answer, answer
    assert result.stopped_on_eos


def test_chat_template_matches_transformers(default_export_int4):
    from transformers import AutoTokenizer

    ours = ChatTokenizer(default_export_int4 / "tokenizer")
    theirs = AutoTokenizer.from_pretrained(default_export_int4 / "tokenizer")
    conversation = [{"role": "system", "content": "Be brief."}, *QUESTION,
                    {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    expected = theirs.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert ours.encode_chat(conversation) == expected
    assert ours.encode_chat(conversation)[0] != ours.encode_chat(conversation)[1], "no double BOS"
