"""A tiny Llama GGUF written the way llama.cpp's converter writes one (Q/K rows permuted,
innermost-first shapes, Q8_0/Q4_0/Q4_1/F16/F32 tensors), with the HF tensors it came from: for
the GGUF reader and keep-mode tests and the gguf-keep benchmark's test."""

from __future__ import annotations

import numpy as np

from export.weights.gguf_source import hf_name

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 96, 4, 2, 2, 320
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama's Q and K rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path, types: dict[str, str], tie: bool = False, seed: int = 0,
                     extra: dict[str, np.ndarray] | None = None, strings: dict[str, str] | None = None):
    """HF-named f32 tensors and the GGUF written from them (``types``: GGUF name suffix -> type;
    ``extra``: more GGUF-named tensors written as they are, e.g. ``rope_freqs.weight``;
    ``strings``: more string metadata fields, e.g. ``llama.rope.scaling.type``)."""
    import gguf

    rng = np.random.default_rng(seed)
    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = rng.standard_normal(HIDDEN).astype(np.float32)
        hf[p + "post_attention_layernorm.weight"] = rng.standard_normal(HIDDEN).astype(np.float32)
        for proj, rows, cols in (("self_attn.q_proj", HEADS * HEAD_DIM, HIDDEN),
                                 ("self_attn.k_proj", KV_HEADS * HEAD_DIM, HIDDEN),
                                 ("self_attn.v_proj", KV_HEADS * HEAD_DIM, HIDDEN),
                                 ("self_attn.o_proj", HIDDEN, HIDDEN),
                                 ("mlp.gate_proj", FFN, HIDDEN), ("mlp.up_proj", FFN, HIDDEN),
                                 ("mlp.down_proj", HIDDEN, FFN)):
            hf[p + proj + ".weight"] = rng.standard_normal((rows, cols)).astype(np.float32)
    hf["model.norm.weight"] = rng.standard_normal(HIDDEN).astype(np.float32)
    if not tie:
        hf["lm_head.weight"] = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i}" for i in range(VOCAB)])
    writer.add_token_types([3 if i < 3 else 1 for i in range(VOCAB)])
    writer.add_token_merges(["t o", "to k"])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_bool("test.flag", True)
    for key, value in (strings or {}).items():
        writer.add_string(key, value)
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}
    for name, value in hf.items():
        gname = gguf_names.get(name) or next(
            f"blk.{name.split('.')[2]}.{g}.weight" for g in
            ("attn_q", "attn_k", "attn_v", "attn_output", "attn_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
            if hf_name(f"blk.{name.split('.')[2]}.{g}.weight") == name)
        assert hf_name(gname) == name
        if ".attn_q." in gname:
            value = llama_cpp_permute(value, HEADS)
        elif ".attn_k." in gname:
            value = llama_cpp_permute(value, KV_HEADS)
        kind = types.get(gname.split(".")[-2], "F32") if value.ndim == 2 else "F32"
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(gname, value)
        elif kind == "F16":
            writer.add_tensor(gname, value.astype(np.float16))
        else:
            writer.add_tensor(gname, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    for gname, value in (extra or {}).items():
        writer.add_tensor(gname, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


MIXED = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "F16",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q4_1", "output": "Q8_0"}
