"""Pure parts of the graph builder: rotary tables against HF's, config parsing, errors, no torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import export.builder.export  # noqa: F401 - imports openvino, which starts a thread: not inside a test
from export.builder.families import UnsupportedModelError, model_shape
from export.builder.rope import inverse_frequencies

BASE = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 32768}
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 8192},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4096,
                 "short_factor": list(np.linspace(1.0, 2.0, 32)), "long_factor": list(np.linspace(1.0, 30.0, 32))},
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rotary_tables_equal_transformers(kind):
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = {**BASE, "rope_parameters": ROPES[kind]}
    shape = model_shape(config)
    tables = inverse_frequencies(shape.rope, shape.head_dim, shape.max_positions)
    hf = LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})
    if kind == "default":
        want = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
        scaling = 1.0
    else:
        want, scaling = ROPE_INIT_FUNCTIONS[kind](hf, None)
    np.testing.assert_allclose(tables.inv_freq, want.numpy(), rtol=2e-6)
    assert tables.scaling == pytest.approx(scaling, rel=1e-9)
    if kind == "longrope":
        long, _ = ROPE_INIT_FUNCTIONS[kind](hf, None, seq_len=4097)
        np.testing.assert_allclose(tables.long_inv_freq, long.numpy(), rtol=2e-6)
        assert tables.switch_at == 4096


def test_legacy_rope_scaling_keys_are_read():
    shape = model_shape({**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert shape.rope["rope_type"] == "linear" and shape.rope["rope_theta"] == 5e5


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "gpt2"}, "supported: .*llama"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "supported rope types"),
    ({"hidden_act": "gelu"}, "only silu"),
    ({"partial_rotary_factor": 0.75}, "partial rotary"),
    ({"num_key_value_heads": 3}, "not a multiple"),
])
def test_unsupported_configs_are_refused_with_what_is_supported(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        model_shape({**BASE, **change})


def test_family_options_follow_the_config():
    qwen2 = model_shape({**BASE, "model_type": "qwen2"})
    assert qwen2.qkv_bias and not qwen2.o_bias
    llama = model_shape({**BASE, "attention_bias": True})
    assert llama.qkv_bias and llama.o_bias
    assert model_shape({**BASE, "model_type": "qwen3"}).family.q_norm is not None
    assert model_shape({**BASE, "model_type": "phi3"}).family.fused_qkv is not None


def test_the_builder_imports_no_torch():
    code = ("import sys, export.builder.export, export.builder.stage_graph; "
            "bad = [m for m in ('torch', 'transformers', 'nncf') if m in sys.modules]; "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
