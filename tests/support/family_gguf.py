"""A tiny HF checkpoint (tests/support/tiny_models.py) written as a GGUF the way llama.cpp's
convert_hf_to_gguf.py writes its family: Llama and Mistral as ``llama`` (Q/K rows permuted, a Mistral
named so in ``general.name``), Qwen2 as ``qwen2`` (q/k/v biases), Phi-3 as ``phi3`` (fused ``attn_qkv``,
gate+up fused in ``ffn_up``, longrope factors as ``rope_factors_long``/``rope_factors_short`` with the
original context length and attention factor as keys). For the GGUF-route identity tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from tests.support.llama_gguf import llama_cpp_permute

ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "phi3": "phi3"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    """The GGUF name llama.cpp's converter gives HF tensor ``hf``."""
    if hf in _GLOBAL:
        return _GLOBAL[hf] + ".weight"
    _, _, index, rest = hf.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{index}.{_LAYER[part]}.{kind}"


def write_family_gguf(checkpoint: Path, path: Path, family: str, tensor_type: str = "F32",
                      rope_dims: int | None = None) -> dict[str, np.ndarray]:
    """``checkpoint`` (a tiny ``family`` model) as a GGUF at ``path``: matrices stored as
    ``tensor_type`` (F32, F16, Q8_0...), norms and biases F32, as the converter stores them;
    ``rope_dims`` overrides the rotary dimension count (a Phi-4-mini-like partial rotary). Returns
    the checkpoint's HF tensors."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    hf = load_file(str(checkpoint / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    arch = ARCHITECTURES[family]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {family}".replace("mistral", "Mistral"))
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base((config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(rope_dims or head_dim)
    rope = config.get("rope_parameters") or {}
    if family == "phi3" and rope.get("rope_type") == "longrope":
        original = config["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        rotary = (rope_dims or head_dim) // 2  # one factor per rotary frequency
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"][:rotary], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"][:rotary], np.float32))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i}" for i in range(config["vocab_size"])])
    writer.add_token_types([3 if i < 3 else 1 for i in range(config["vocab_size"])])
    writer.add_token_merges(["t o", "to k"])
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for name, value in hf.items():
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            value = llama_cpp_permute(value, heads)
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            value = llama_cpp_permute(value, kv_heads)
        if value.ndim != 2 or tensor_type == "F32":
            writer.add_tensor(gguf_name(name), value.astype(np.float32))
        elif tensor_type == "F16":
            writer.add_tensor(gguf_name(name), value.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf
