"""A tiny Llama GGUF the way a chat model ships: a gpt2-style BPE tokenizer, SmolLM2's special
tokens and a chat template, random weights. For the model-source and torch-free export tests."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_chat_gguf(path: Path, *, seed: int = 0) -> Path:
    """A 2-layer Llama GGUF with a gpt2-style BPE tokenizer, SmolLM2's special tokens and a chat
    template; ``add_bos_token`` is false, like SmolLM2's."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*special, *bytes_to_unicode().values(), "He", "ll", "Hell", "Hello"]
    types = [gguf.TokenType.CONTROL] * len(special) + [gguf.TokenType.NORMAL] * (
        len(tokens) - len(special)
    )

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-test-llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["H e", "l l", "He ll", "Hell o"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    add_tiny_llama(writer, len(tokens), seed)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_tiny_llama(writer: gguf.GGUFWriter, vocab_size: int, seed: int = 0) -> None:
    """A 2-layer Llama's hyper-parameters and random weights (scale 0.5) into ``writer``, for a
    vocabulary of ``vocab_size`` tokens (the tokenizer is the caller's)."""
    hidden, layers, heads, kv_heads, inter = 64, 2, 4, 2, 128
    head_dim = hidden // heads
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size)
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    ones = np.ones(hidden, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weight(vocab_size, hidden))
    for i in range(layers):
        for name, tensor in (("attn_norm", ones), ("ffn_norm", ones), ("attn_q", weight(hidden, hidden)),
                             ("attn_k", weight(kv_heads * head_dim, hidden)),
                             ("attn_v", weight(kv_heads * head_dim, hidden)), ("attn_output", weight(hidden, hidden)),
                             ("ffn_gate", weight(inter, hidden)), ("ffn_up", weight(inter, hidden)),
                             ("ffn_down", weight(hidden, inter))):
            writer.add_tensor(f"blk.{i}.{name}.weight", tensor)
    writer.add_tensor("output_norm.weight", ones)
