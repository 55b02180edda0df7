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
from tests.support.llama_gguf import MIXED, write_llama_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_llama_gguf(path, MIXED)
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
    hf = write_llama_gguf(tmp_path / "f32.gguf", {})  # all F32: exact
    source = GGUFSource(tmp_path / "f32.gguf")
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        np.testing.assert_array_equal(source.read(name), hf[name])
        np.testing.assert_array_equal(source.read_rows(name, 3, 11), hf[name][3:11])
    assert source.config["tie_word_embeddings"] is False


def test_tied_gguf_has_no_head(tmp_path):
    write_llama_gguf(tmp_path / "tied.gguf", {}, tie=True)
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
