"""The graph builder's shards: HF-identical tokens, the fused CPU runtime graph, paged-attention ready.

Every architecture is exported once per stage count (the session's ``tiny_export``) from a
tiny random checkpoint and run by the unchanged engine under the exact settings.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import openvino as ov
import pytest

from engine.generation.in_process import greedy_generate
from engine.shards.manifest import load_manifest
from engine.shards.stage import EXACT_PROPERTIES, LocalChain, StepInputs
from tests.conftest import FAMILIES as TRACED_FAMILIES
from tests.conftest import PROMPT_IDS

FAMILIES = ("llama", "llama3", "qwen2", "mistral", "qwen3", "phi3")
N_TOKENS = 32
QK_NORM = {"qwen3"}

# Per decoder layer, the CPU runtime model of optimum-intel's export of the same architectures
# (recorded once): one fused attention reading the cache from MemoryInputs, the rotary of q and
# k fused (2 RoPE), the two RMS norms (two more for Qwen3's q/k norms), at most two Transposes
# (V and the attention output; q/k's are folded into RoPE) and no StridedSlice.
REFERENCE_PER_LAYER = {"ScaledDotProductAttention": 1, "RoPE": 2, "RMS": 2}
MAX_TRANSPOSES_PER_LAYER = 2


@pytest.fixture(scope="module")
def built(tiny_export):
    """``built(family, stages)`` -> fp32 / f32-KV export through ``deskfleet export``'s path (the
    builder), shared with the other export tests of the session."""
    return lambda family, stages=1: tiny_export(family, stages)


# The four traced-era families keep their identity test in tests/export/test_export_identity.py (same
# export path, same fixture); the builder's new families get theirs here.
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(TRACED_FAMILIES)))
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_chained_greedy_equals_hf_torch(family, stages, built, hf_greedy):
    chain = LocalChain.load(built(family, stages), exact=True)
    result = greedy_generate(chain, PROMPT_IDS, N_TOKENS, ignore_eos=True)
    expected = hf_greedy(family, N_TOKENS)
    assert len(set(expected)) > 4, "the random model must not repeat one token, or identity proves nothing"
    assert result.tokens == expected


def _layer_type(node) -> str:
    return node.get_rt_info()["layerType"].astype(str)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_runtime_model_has_the_reference_fused_nodes(family, built):
    export = built(family, 1)
    manifest = load_manifest(export)
    layers = manifest.model.num_layers
    core = ov.Core()
    compiled = core.compile_model(core.read_model(export / manifest.stages[0].xml), "CPU", dict(EXACT_PROPERTIES))
    ops = compiled.get_runtime_model().get_ops()
    counts = Counter(_layer_type(op) for op in ops)
    expected = dict(REFERENCE_PER_LAYER)
    if family in QK_NORM:
        expected["RMS"] += 2
    assert counts["ScaledDotProductAttention"] == expected["ScaledDotProductAttention"] * layers
    assert counts["RoPE"] == expected["RoPE"] * layers
    assert counts["RMS"] == expected["RMS"] * layers + 1  # + the final norm
    assert counts["Transpose"] <= MAX_TRANSPOSES_PER_LAYER * layers
    assert counts["StridedSlice"] == 0
    for op in ops:
        if _layer_type(op) == "ScaledDotProductAttention":
            feeding = Counter(_layer_type(v.get_node()) for v in op.input_values())
            assert feeding["MemoryInput"] == 2, f"attention not fused with its K/V state: fed by {dict(feeding)}"


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_stage_converts_to_paged_attention_and_compiles(family, built):
    from openvino._offline_transformations import paged_attention_transformation

    export = built(family, 3)
    manifest = load_manifest(export)
    core = ov.Core()
    for spec in manifest.stages:
        model = core.read_model(export / spec.xml)
        first = "input_ids" if spec.has_embedding else "inputs_embeds"
        param = model.get_parameters()[0]
        assert param.get_friendly_name() == first and param.output(0).get_names() == {first}
        paged_attention_transformation(model, False, False, False)
        names = {p.get_any_name() for p in model.inputs}
        assert {"past_lens", "block_indices", first} <= names and "attention_mask" not in names
        assert sum(n.startswith("key_cache.") for n in names) == spec.num_layers
        core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


def test_logits_last_keeps_only_the_trailing_rows(built):
    chain = LocalChain.load(built("qwen2", 2), exact=True)
    ids = np.array([PROMPT_IDS], dtype=np.int64)
    n = ids.shape[1]
    step = StepInputs(ids, np.ones((1, n), np.int64), np.arange(n, dtype=np.int64)[None])
    every = LocalChain.forward(chain.new_streams(), step)
    last3 = LocalChain.forward(chain.new_streams(), StepInputs(step.x, step.attention_mask, step.position_ids, 3))
    assert every.shape[1] == n and last3.shape[1] == 3
    np.testing.assert_allclose(last3, every[:, -3:], rtol=0, atol=1e-5)


def test_a_masked_cache_position_is_invisible(built):
    """Same semantics as the traced graph: a slot switched off in attention_mask (a rejected draft)
    changes nothing, the next token keeping its logical position."""
    chain = LocalChain.load(built("llama", 2), exact=True)
    ids = np.array([PROMPT_IDS], dtype=np.int64)
    n = ids.shape[1]
    positions = np.arange(n, dtype=np.int64)[None]
    clean = chain.new_streams()
    LocalChain.forward(clean, StepInputs(ids, np.ones((1, n), np.int64), positions, 1))
    want = LocalChain.forward(clean, StepInputs(np.array([[5]]), np.ones((1, n + 1), np.int64),
                                                np.array([[n]]), 1))
    dirty = chain.new_streams()
    LocalChain.forward(dirty, StepInputs(np.concatenate([ids, [[77]]], axis=1), np.ones((1, n + 1), np.int64),
                                         np.arange(n + 1, dtype=np.int64)[None], 1))
    mask = np.ones((1, n + 2), np.int64)
    mask[0, n] = 0  # the rejected token
    got = LocalChain.forward(dirty, StepInputs(np.array([[5]]), mask, np.array([[n]]), 1))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_longrope_takes_the_long_factors_past_the_original_window_like_hf(built, tiny_checkpoint):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("phi3"), dtype=torch.float32)
    chain = LocalChain.load(built("phi3", 1), exact=True)
    rng = np.random.default_rng(0)
    for n in (40, 80):  # the tiny Phi-3's original window is 64
        ids = rng.integers(3, 500, size=(1, n), dtype=np.int64)
        with torch.no_grad():
            want = model(torch.tensor(ids)).logits.numpy()
        got = LocalChain.forward(chain.new_streams(), StepInputs(ids, np.ones((1, n), np.int64),
                                                                 np.arange(n, dtype=np.int64)[None]))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)


def test_a_missing_tensor_is_named_and_nothing_is_written(tiny_checkpoint, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    from export.exporter import ExportError, ExportOptions, export_model

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("qwen3"), ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.3.self_attn.k_norm.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="layers.3.self_attn.k_norm.weight.*missing.*stage 1.*incomplete"):
        export_model(ckpt, out, stages=2, fingerprint="x", options=ExportOptions(weights="fp32"))
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if "out" in p.name] == []
