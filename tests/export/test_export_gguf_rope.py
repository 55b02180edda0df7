"""A Llama 3.1-style GGUF carries its llama3 rope scaling as ``rope_freqs.weight``: the GGUF
route must rotate as HF torch does with the same ``rope_scaling``, and refuse tensors it cannot use.

The tiny GGUF (tests/support/llama_gguf.py) gets the factors computed as llama.cpp's converter
computes them (per frequency: 1 above the high-frequency wavelength, ``factor`` beyond the
low-frequency one, ``1 / ((1 - s) / factor + s)`` between) and no ``rope.scaling.type``. An
original window of 32 positions makes the scaling change every position of a short prompt: the
default rope and the llama3 rope give different greedy tokens, so the test can fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from export.weights.checkpoint import CheckpointError
from export.weights.gguf_source import ROPE_FREQS, GGUFSource
from tests.support import llama_gguf

LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
PROMPT = (1, 87, 85, 267, 201, 299, 266, 286, 273, 33, 2, 201, 1, 301)
N_TOKENS = 16


def llama_cpp_rope_factors(p: dict, head_dim: int) -> np.ndarray:
    """The rope_freqs values llama.cpp's converter writes for ``rope_type: llama3`` (in f32)."""
    freqs = (1.0 / (np.float32(p["rope_theta"]) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)))
    old, low, high, factor = (p["original_max_position_embeddings"], p["low_freq_factor"],
                              p["high_freq_factor"], p["factor"])
    out = []
    for freq in freqs.astype(np.float32):
        wavelen = np.float32(2 * math.pi) / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)
            out.append(np.float32(1) / ((1 - smooth) / np.float32(factor) + smooth))
    return np.asarray(out, dtype=np.float32)


FACTORS = llama_cpp_rope_factors(LLAMA3, llama_gguf.HEAD_DIM)


@pytest.fixture(scope="module")
def llama31_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama31") / "tiny-llama31.gguf"
    hf = llama_gguf.write_llama_gguf(path, {}, seed=7, extra={ROPE_FREQS: FACTORS})  # all F32: exact
    return path, hf


def hf_greedy(hf_tensors: dict, rope: dict | None) -> tuple[int, ...]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    g = llama_gguf
    config = LlamaConfig(vocab_size=g.VOCAB, hidden_size=g.HIDDEN, intermediate_size=g.FFN,
                         num_hidden_layers=g.LAYERS, num_attention_heads=g.HEADS, num_key_value_heads=g.KV_HEADS,
                         head_dim=g.HEAD_DIM, rms_norm_eps=1e-5, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in hf_tensors.items()}, strict=True)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return tuple(out[0, len(PROMPT):].tolist())


def test_the_factors_reach_the_config(llama31_gguf):
    source = GGUFSource(llama31_gguf[0])
    rope = source.config["rope_parameters"]
    assert rope["rope_type"] == "default"
    np.testing.assert_array_equal(np.asarray(rope["freq_factors"], np.float32), FACTORS)
    assert FACTORS[0] == 1.0 and FACTORS[-1] == 8.0 and 1.0 < FACTORS[1] < 8.0  # all three bands


@pytest.mark.parametrize("stages", [1, 2])
def test_gguf_route_rotates_as_hf_llama3(llama31_gguf, tmp_path, stages):
    from engine.generation.in_process import greedy_generate
    from engine.shards.stage import LocalChain
    from export.exporter import ExportOptions, export_model

    path, hf = llama31_gguf
    expected = hf_greedy(hf, LLAMA3)
    assert expected != hf_greedy(hf, None), "the llama3 scaling must change the tokens, or this proves nothing"
    assert len(set(expected)) > 4
    out = tmp_path / "export"
    export_model(path, out, stages=stages, options=ExportOptions(weights="fp32"))
    chain = LocalChain.load(out, exact=True)
    assert greedy_generate(chain, PROMPT, N_TOKENS, ignore_eos=True).tokens == expected


def test_an_unknown_tensor_is_refused_by_name(tmp_path):
    path = tmp_path / "extra.gguf"
    llama_gguf.write_llama_gguf(path, {}, extra={"blk.0.ffn_gate_inp.weight": np.ones((4, 64), np.float32)})
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_gate_inp\.weight.*rope_freqs\.weight"):
        GGUFSource(path)


def test_rope_freqs_of_the_wrong_length_is_refused(tmp_path):
    path = tmp_path / "short.gguf"
    llama_gguf.write_llama_gguf(path, {}, extra={ROPE_FREQS: FACTORS[:-1]})
    with pytest.raises(CheckpointError, match=r"rope_freqs\.weight .*shape \[7\]; expected .*shape \[8\]"):
        GGUFSource(path)


def test_a_bare_llama3_scaling_type_is_refused(tmp_path):
    """llama3 scaling without its factors: the file lacks the numbers, so say so (not a KeyError)."""
    path = tmp_path / "bare-llama3.gguf"
    llama_gguf.write_llama_gguf(path, {}, strings={"llama.rope.scaling.type": "llama3"})
    with pytest.raises(CheckpointError, match=r"rope scaling type 'llama3' but carries no rope_freqs\.weight"):
        GGUFSource(path)


def test_npu_target_rotates_as_hf_llama3(llama31_gguf, tmp_path):
    """The static NPU graphs read the GGUF through the same reader as the stateful ones: the
    rope_freqs factors reach them too (no transformers conversion in between)."""
    from engine.static.packed_stage import StaticChain, static_generate
    from export.exporter import ExportOptions, export_model

    path, hf = llama31_gguf
    out = tmp_path / "npu"
    export_model(path, out, stages=2, options=ExportOptions(weights="fp32", target="npu", context=64, prefill_chunk=8))
    chain = StaticChain.load(out, exact=True)
    assert static_generate(chain, PROMPT, N_TOKENS, ignore_eos=True) == list(hf_greedy(hf, LLAMA3))


def test_a_recognised_tensor_no_stage_reads_is_refused_by_name(tmp_path):
    """An attention-output bias in a llama GGUF is a tensor the reader knows, but the llama config
    has no o_proj bias: dropping it silently would change the math, so the export names it."""
    from export.exporter import ExportError, ExportOptions, export_model

    path = tmp_path / "o-bias.gguf"
    llama_gguf.write_llama_gguf(path, {}, extra={"blk.1.attn_output.bias": np.ones(llama_gguf.HIDDEN, np.float32)})
    for target in ({}, {"target": "npu", "context": 32}):
        out = tmp_path / "out"
        with pytest.raises(ExportError, match=r"'blk\.1\.attn_output\.bias' \(model\.layers\.1\.self_attn\.o_proj"
                                              r"\.bias\).*would change the model's math"):
            export_model(path, out, stages=2, options=ExportOptions(weights="fp32", **target), fingerprint="x")
        assert not out.exists()
