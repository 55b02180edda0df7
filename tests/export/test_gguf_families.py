"""GGUFs of the dense families other than Llama export to the very shards their safetensors
checkpoints do: Qwen2 (``qwen2``, q/k/v biases), Mistral (a ``llama`` GGUF named Mistral, Q/K rows
permuted) and Phi-3 (``phi3``: fused ``attn_qkv``, gate+up fused in ``ffn_up``, longrope factors as
tensors).

Each GGUF is written here from the session's tiny random checkpoint as llama.cpp's converter writes
it (tests/support/family_gguf.py). F32 GGUFs must give the checkpoint's fp32 weights files byte for
byte and its greedy tokens; an F16 Phi-3 GGUF its fp16 files; a Q8_0 Phi-3 GGUF keeps its blocks
(``--weights keep``) and gives the tokens of the same GGUF dequantised.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.generation.in_process import greedy_generate
from engine.shards.manifest import load_manifest
from engine.shards.stage import LocalChain
from export.builder.families import UnsupportedModelError, model_shape
from export.exporter import ExportError, ExportOptions, export_model
from export.weights.gguf_source import GGUFSource
from tests.conftest import PROMPT_IDS
from tests.support.family_gguf import write_family_gguf


def _tokens(export_dir: Path) -> list[int]:
    return greedy_generate(LocalChain.load(export_dir, exact=True), PROMPT_IDS, 12, ignore_eos=True).tokens


def _same_weight_files(ours: Path, reference: Path) -> None:
    mine, theirs = load_manifest(ours), load_manifest(reference)
    assert [(s.first_layer, s.last_layer) for s in mine.stages] == [(s.first_layer, s.last_layer)
                                                                    for s in theirs.stages]
    for a, b in zip(mine.stages, theirs.stages, strict=True):
        bins = [(f.path, r.path) for f, r in zip(a.files, b.files, strict=True) if f.path.endswith(".bin")]
        assert bins
        for x, y in bins:
            assert (ours / x).read_bytes() == (reference / y).read_bytes(), x


@pytest.mark.parametrize("family", ["qwen2", "mistral", "phi3"])
def test_an_f32_gguf_exports_the_checkpoints_shards(family, tiny_checkpoint, tiny_export, tmp_path):
    path = tmp_path / f"{family}.gguf"
    write_family_gguf(tiny_checkpoint(family), path, family)
    with GGUFSource(path) as source:
        from_gguf = model_shape(source.config)
    from_checkpoint = model_shape(json.loads((tiny_checkpoint(family) / "config.json").read_text()))
    assert from_gguf.family.model_type == family
    for field in ("num_layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "tied",
                  "qkv_bias", "o_bias", "mlp_bias", "max_positions"):
        assert getattr(from_gguf, field) == getattr(from_checkpoint, field), field
    assert from_gguf.rope["rope_type"] == from_checkpoint.rope["rope_type"]

    out = tmp_path / "from-gguf"
    export_model(path, out, stages=1, options=ExportOptions(weights="fp32", group_size=16))
    reference = tiny_export(family, 1)
    _same_weight_files(out, reference)
    tokens = _tokens(out)
    assert len(set(tokens)) > 4, "the random model must not repeat one token, or identity proves nothing"
    assert tokens == _tokens(reference)


def test_phi3_keeps_its_fused_projections_and_longrope(tiny_checkpoint, tmp_path):
    """The fused tensors read back as the checkpoint holds them (gate rows first in gate_up); the
    longrope factor tensors are the config's lists."""
    path = tmp_path / "phi3.gguf"
    hf = write_family_gguf(tiny_checkpoint("phi3"), path, "phi3")
    config = json.loads((tiny_checkpoint("phi3") / "config.json").read_text())
    with GGUFSource(path) as source:
        assert source.names() == frozenset(hf)
        for name in ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"):
            np.testing.assert_array_equal(source.read(name), hf[name], err_msg=name)
        assert source.stored_name("model.layers.1.mlp.gate_up_proj.weight") == "blk.1.ffn_up.weight"
        rope = source.config["rope_parameters"]
    want = config["rope_parameters"]
    assert rope["rope_type"] == "longrope" and "attention_factor" not in rope  # derived as HF derives it
    assert rope["original_max_position_embeddings"] == config["original_max_position_embeddings"]
    for key in ("short_factor", "long_factor"):
        np.testing.assert_array_equal(np.float32(rope[key]), np.float32(want[key]))


def test_an_f16_phi3_gguf_exports_the_checkpoints_fp16_shards(tiny_checkpoint, tiny_export, tmp_path):
    path = tmp_path / "phi3-f16.gguf"
    write_family_gguf(tiny_checkpoint("phi3"), path, "phi3", tensor_type="F16")
    with GGUFSource(path) as source:
        assert source.type_name("model.layers.0.self_attn.qkv_proj.weight") == "F16"
    out = tmp_path / "from-gguf"
    export_model(path, out, stages=1, options=ExportOptions(weights="fp16", group_size=16))
    _same_weight_files(out, tiny_export("phi3", 1, "fp16"))


def test_a_q8_0_phi3_gguf_keeps_its_fused_blocks(tiny_checkpoint, tmp_path):
    """Q8_0 fused qkv and gate_up: read as gguf dequantises them, kept as i8 blocks by ``keep``, and
    the kept export's tokens are those of the same GGUF exported to fp32."""
    import gguf
    import openvino as ov

    path = tmp_path / "phi3-q8.gguf"
    hf = write_family_gguf(tiny_checkpoint("phi3"), path, "phi3", tensor_type="Q8_0")
    q8 = gguf.GGMLQuantizationType.Q8_0
    with GGUFSource(path) as source:
        for name in ("model.layers.2.self_attn.qkv_proj.weight", "model.layers.2.mlp.gate_up_proj.weight"):
            assert source.type_name(name) == "Q8_0"
            want = gguf.quants.dequantize(gguf.quants.quantize(hf[name], q8), q8)
            np.testing.assert_array_equal(source.read(name), want, err_msg=name)
    tokens = {}
    for weights in ("keep", "fp32"):
        export_model(path, tmp_path / weights, stages=1, options=ExportOptions(weights=weights))
        tokens[weights] = _tokens(tmp_path / weights)
    assert tokens["keep"] == tokens["fp32"]
    stage = load_manifest(tmp_path / "keep").stages[0]
    model = ov.Core().read_model(tmp_path / "keep" / stage.xml)
    kept = {tuple(op.get_output_shape(0)) for op in model.get_ordered_ops()
            if op.get_type_name() == "Constant" and op.get_output_element_type(0) == ov.Type.i8}
    hidden, inter, qkv_rows = 64, 128, 4 * 16 + 2 * 2 * 16  # (H + 2 KV) * D
    assert (qkv_rows, hidden // 32, 32) in kept
    assert (2 * inter, hidden // 32, 32) in kept  # gate_up


def test_a_phi3_gguf_with_partial_rotary_is_refused_by_name(tiny_checkpoint, tmp_path):
    """A phi3 GGUF rotating part of each head (Phi-4-mini) is refused before any work."""
    path = tmp_path / "phi4-mini-ish.gguf"
    write_family_gguf(tiny_checkpoint("phi3"), path, "phi3", rope_dims=12)
    out = tmp_path / "out"
    with pytest.raises(UnsupportedModelError, match="partial rotary.*Phi-4-mini"):
        export_model(path, out, stages=1, options=ExportOptions(weights="fp32"), fingerprint="x")
    assert not out.exists()


def test_gpt_oss_is_refused_by_name_from_a_gguf(tmp_path):
    import gguf

    path = tmp_path / "gpt-oss.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=r"architecture 'gpt-oss': gpt-oss is not supported yet: .*attention sinks"
                                          r".*supported GGUF architectures: .*qwen3moe"):
        export_model(path, out, stages=1, options=ExportOptions(weights="fp32"), fingerprint="x")
    assert not out.exists()
