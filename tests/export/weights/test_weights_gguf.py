"""export.weights.gguf_source against transformers' GGUF loader on the same file.

A tiny Llama GGUF is written here the way llama.cpp's converter writes one (Q/K rows permuted,
innermost-first shapes, Q8_0/Q4_0/Q4_1/F16/F32 tensors), then read by transformers (torch) and by
GGUFSource (numpy): every tensor and the config must agree.
"""

from __future__ import annotations

import numpy as np
import pytest

from export.weights.checkpoint import CheckpointError, open_checkpoint
from export.weights.gguf_source import GGUFSource, hf_name

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 96, 4, 2, 2, 320
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama's Q and K rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, types: dict[str, str], tie: bool = False, seed: int = 0):
    """HF-named f32 tensors and the GGUF written from them (``types``: GGUF name suffix -> type)."""
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
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


MIXED = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "F16",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q4_1", "output": "Q8_0"}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, MIXED)
    return path


def test_tensors_equal_what_transformers_loads(tiny_gguf):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    source = open_checkpoint(tiny_gguf)
    assert isinstance(source, GGUFSource)
    assert source.names() == frozenset(state)
    for name in sorted(state):
        assert source.shape(name) == state[name].shape, name
        np.testing.assert_array_equal(source.read(name), state[name], err_msg=name)
        if len(state[name].shape) == 2:
            stop = min(37, state[name].shape[0])
            np.testing.assert_array_equal(source.read_rows(name, 5, stop), state[name][5:stop], err_msg=name)
    config = model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "model_type"):
        assert source.config[key] == pytest.approx(getattr(config, key)), key
    assert source.config["rope_theta"] == pytest.approx(config.rope_parameters["rope_theta"])


def test_unpermuted_q_and_k_are_the_original_hf_rows(tmp_path):
    hf = write_tiny_gguf(tmp_path / "f32.gguf", {})  # all F32: exact
    source = GGUFSource(tmp_path / "f32.gguf")
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        np.testing.assert_array_equal(source.read(name), hf[name])
        np.testing.assert_array_equal(source.read_rows(name, 3, 11), hf[name][3:11])
    assert source.config["tie_word_embeddings"] is False


def test_tied_gguf_has_no_head(tmp_path):
    write_tiny_gguf(tmp_path / "tied.gguf", {}, tie=True)
    source = GGUFSource(tmp_path / "tied.gguf")
    assert "lm_head.weight" not in source.names() and source.config["tie_word_embeddings"] is True


def test_a_damaged_gguf_is_explained(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        open_checkpoint(bad)


def test_header_parser_agrees_with_gguf_reader(tiny_gguf):
    import gguf

    reader = gguf.GGUFReader(str(tiny_gguf))
    source = GGUFSource(tiny_gguf)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert set(fields) == set(source.metadata)
    for key, want in fields.items():
        got = source.metadata[key]
        assert (got == pytest.approx(want)) if isinstance(want, float) else got == want, key
    assert source.metadata["test.flag"] is True and source.metadata["tokenizer.ggml.tokens"][319] == "tok319"
    for tensor in reader.tensors:
        raw = source.blocks(hf_name(tensor.name)).data
        np.testing.assert_array_equal(np.asarray(raw).reshape(-1).view(np.uint8),
                                      np.asarray(tensor.data).reshape(-1).view(np.uint8), err_msg=tensor.name)


def test_a_truncated_gguf_is_explained(tiny_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated"):
        GGUFSource(cut)
