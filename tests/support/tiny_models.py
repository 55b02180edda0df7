"""Tiny random-weight checkpoints for tests, built from a config in code (no hub needed).

The weights use a large init range: with the usual 0.02 a random model greedily repeats one
token, and an identity test over such output proves nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma4TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

# Shared by every family: hidden 64, 4 layers, 4 heads, 2 KV heads (GQA), head_dim 16.
_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

TINY_CONFIGS = {
    "llama": lambda vocab: LlamaConfig(vocab_size=vocab, tie_word_embeddings=True, **_COMMON),
    "llama3": lambda vocab: LlamaConfig(
        vocab_size=vocab,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        **_COMMON,
    ),
    "qwen2": lambda vocab: Qwen2Config(vocab_size=vocab, tie_word_embeddings=True, **_COMMON),
    "mistral": lambda vocab: MistralConfig(vocab_size=vocab, tie_word_embeddings=False, sliding_window=None, **_COMMON),
    "qwen3": lambda vocab: Qwen3Config(vocab_size=vocab, tie_word_embeddings=True, head_dim=16, **_COMMON),
    # 8 experts, 2 per token, renormalised; layer 2 dense (mlp_only_layers) so both kinds of layer
    # are built, and a 2-stage split has MoE layers on both sides.
    "qwen3_moe": lambda vocab: Qwen3MoeConfig(
        vocab_size=vocab, tie_word_embeddings=True, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2], **_COMMON),
    # longrope (as Phi-3.5-mini) with a short original window: a sequence longer than 64 takes
    # the long factors. HF's Phi-3 generate re-prefills its whole cache when it crosses that point.
    "phi3": lambda vocab: Phi3Config(
        vocab_size=vocab,
        tie_word_embeddings=False,
        sliding_window=None,
        original_max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            "long_factor": [1.2, 1.9, 2.8, 4.0, 5.5, 7.3, 9.4, 12.0],
            "original_max_position_embeddings": 64,
        },
        **_COMMON,
    ),
    # Gemma 4 text: sliding (window 8, head_dim 16, 2 KV heads) and full layers (head_dim 32, one
    # KV head, keys = values, proportional rope over a quarter of the head); per-layer embeddings;
    # the last 3 layers reuse the K/V of layer 2 (sliding) and 1 (full), and have double-wide MLPs;
    # final logits soft-capped. Norm gammas and layer scalars are random (see _randomise_vectors).
    "gemma4": lambda vocab: Gemma4TextConfig(
        vocab_size=vocab, tie_word_embeddings=True, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=8, num_kv_shared_layers=3, use_double_wide_mlp=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                     "sliding_attention", "full_attention"],
        vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=8, final_logit_softcapping=2.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}},
        **{**_COMMON, "num_hidden_layers": 6}),
    # Gemma 4 with MoE blocks (as 26B-A4B: no PLE, no K/V sharing, keys = values on full layers):
    # 4 experts, 2 per token, beside each layer's dense MLP.
    "gemma4_moe": lambda vocab: Gemma4TextConfig(
        vocab_size=vocab, tie_word_embeddings=True, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=8, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32, hidden_size_per_layer_input=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=2.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}},
        **_COMMON),
}
# Families whose init leaves norm gammas and scalars at one: random instead, so that a builder
# that skips one of them (or applies it twice) gives other tokens.
_RANDOM_VECTORS = frozenset({"gemma4", "gemma4_moe"})


def _randomise_vectors(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.dim() == 1 and tensor.is_floating_point():
                tensor.uniform_(0.6, 1.4)
            elif name == "model.embed_tokens.weight":
                # Gemma scales its embeddings by sqrt(hidden): at this init the residual would be the
                # input token's embedding, and the (tied) head would repeat the last token forever.
                tensor.mul_(0.125)


# ChatML, as SmolLM2 uses it; ids 0..2 are the special tokens the tiny configs point at.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = (
    "The capital of France is Paris. Deskfleet pools the idle office computers of a company. "
    "Every stage runs a contiguous range of layers and passes hidden states to the next one. "
    "What is the weather like today? Hello, how are you? I am a small random model."
)


def build_tiny_tokenizer(out_dir: Path | str, vocab_size: int = 512) -> Path:
    """A byte-level BPE tokenizer trained in milliseconds, with a ChatML chat template."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[1],
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 512,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


def build_tiny_model(out_dir: Path | str, family: str = "llama", vocab_size: int = 512, seed: int = 0,
                     with_tokenizer: bool = True) -> Path:
    """Save a random-weight checkpoint of ``family`` (and a matching tokenizer) to ``out_dir``."""
    out = Path(out_dir)
    config = TINY_CONFIGS[family](vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family in _RANDOM_VECTORS:
        _randomise_vectors(model)
    model.save_pretrained(out)
    if with_tokenizer:
        build_tiny_tokenizer(out, vocab_size)
    return out
