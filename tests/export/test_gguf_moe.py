"""A Qwen3-MoE GGUF (``qwen3moe``: experts stacked into 3-D ``blk.N.ffn_*_exps`` tensors, the router as
``ffn_gate_inp``) exports to the very shards its safetensors checkpoint does.

The GGUF is written here, the way llama.cpp's converter writes one, from the session's tiny random
``qwen3_moe`` checkpoint (tests/support/tiny_models.py: 8 experts, top-2, layer 2 dense), all F32, so
both routes must agree bit for bit; the safetensors export is the session's shared ``tiny_export``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.generation.in_process import greedy_generate
from engine.shards.manifest import load_manifest
from engine.shards.stage import LocalChain
from export.builder.families import model_shape
from export.weights.checkpoint import CheckpointError
from export.weights.gguf_source import GGUF_ARCHITECTURES, GGUFSource
from tests.conftest import PROMPT_IDS

FAMILY = "qwen3_moe"
EXPERTS = 8
_ATTENTION = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}


def write_qwen3moe_gguf(checkpoint: Path, path: Path, expert_type: str = "F32") -> dict[str, np.ndarray]:
    """``checkpoint``'s tensors as a ``qwen3moe`` GGUF (experts stacked per layer and projection, as
    llama.cpp's converter stacks them; ``expert_type`` their GGML type); returns the HF tensors."""
    import json

    import gguf
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    hf = load_file(str(checkpoint / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_name("tiny qwen3 moe")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i}" for i in range(config["vocab_size"])])
    writer.add_token_types([3 if i < 3 else 1 for i in range(config["vocab_size"])])
    writer.add_token_merges(["t o", "to k"])
    writer.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", hf["model.norm.weight"])
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for hf_part, gguf_part in _ATTENTION.items():
            if p + hf_part + ".weight" in hf:
                writer.add_tensor(f"blk.{i}.{gguf_part}.weight", hf[p + hf_part + ".weight"])
        for proj, gguf_part in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                                ("down_proj", "ffn_down_exps")):
            if p + f"mlp.experts.0.{proj}.weight" not in hf:
                continue
            stacked = np.stack([hf[p + f"mlp.experts.{e}.{proj}.weight"] for e in range(EXPERTS)])  # [E, out, in]
            qtype = gguf.GGMLQuantizationType[expert_type]
            if expert_type == "F32":
                writer.add_tensor(f"blk.{i}.{gguf_part}.weight", stacked)
            elif expert_type == "F16":
                writer.add_tensor(f"blk.{i}.{gguf_part}.weight", stacked.astype(np.float16))
            else:
                writer.add_tensor(f"blk.{i}.{gguf_part}.weight", gguf.quants.quantize(stacked, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory, tiny_checkpoint) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("qwen3moe-gguf") / "tiny-qwen3moe.gguf"
    return path, write_qwen3moe_gguf(tiny_checkpoint(FAMILY), path)


def test_the_config_from_the_gguf_is_the_checkpoints_shape(moe_gguf, tiny_checkpoint):
    import json

    with GGUFSource(moe_gguf[0]) as source:
        from_gguf = model_shape(source.config)
    from_checkpoint = model_shape(json.loads((tiny_checkpoint(FAMILY) / "config.json").read_text()))
    assert from_gguf.family.model_type == FAMILY
    assert from_gguf.moe == from_checkpoint.moe and from_gguf.moe is not None
    assert from_gguf.moe.layers == frozenset({0, 1, 3})  # layer 2 has no router: dense, as mlp_only_layers says
    assert from_gguf.moe.normalise  # llama.cpp's qwen3moe always renormalises the top-k weights
    for field in ("num_layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab", "tied",
                  "qkv_bias", "o_bias", "mlp_bias"):
        assert getattr(from_gguf, field) == getattr(from_checkpoint, field), field
    assert np.float32(from_gguf.eps) == np.float32(from_checkpoint.eps)  # a GGUF stores it as f32
    assert from_gguf.rope["rope_theta"] == from_checkpoint.rope["rope_theta"]


def test_each_expert_is_read_alone_as_the_checkpoint_holds_it(moe_gguf):
    """Every HF tensor, experts one by one, reads back as the checkpoint's; an expert's bytes are a
    window of one expert into the stack (what the export streams), not the stacked tensor."""
    path, hf = moe_gguf
    with GGUFSource(path) as source:
        assert source.names() == frozenset(hf)
        for name, value in hf.items():
            np.testing.assert_array_equal(source.read(name), value, err_msg=name)
        expert = "model.layers.3.mlp.experts.5.down_proj.weight"
        assert source.blocks(expert).data.nbytes == hf[expert].nbytes
        assert "ffn_down_exps" in source.stored_name(expert) and "expert 5" in source.stored_name(expert)


@pytest.mark.parametrize("kind", ["F16", "Q8_0"])
def test_stored_experts_are_split_on_their_own_blocks(tiny_checkpoint, tmp_path, kind):
    """F16 and block-quantised stacks: each expert's rows are its own, dequantised as gguf does."""
    import gguf

    path = tmp_path / f"{kind}.gguf"
    hf = write_qwen3moe_gguf(tiny_checkpoint(FAMILY), path, expert_type=kind)
    qtype = gguf.GGMLQuantizationType[kind]
    with GGUFSource(path) as source:
        for e in (0, 3, EXPERTS - 1):
            name = f"model.layers.1.mlp.experts.{e}.up_proj.weight"
            assert source.type_name(name) == kind
            expected = hf[name].astype(np.float16).astype(np.float32) if kind == "F16" else \
                gguf.quants.dequantize(gguf.quants.quantize(hf[name], qtype), qtype)
            np.testing.assert_array_equal(source.read(name), expected)
            np.testing.assert_array_equal(source.read_rows(name, 7, 19), expected[7:19])


@pytest.mark.parametrize("stages", [1, 2])
def test_the_gguf_exports_the_checkpoints_shards(moe_gguf, tiny_export, tmp_path, stages):
    """Same weights files byte for byte, same greedy tokens: the GGUF route is the checkpoint route."""
    from export.exporter import ExportOptions, export_model

    out = tmp_path / "from-gguf"
    export_model(moe_gguf[0], out, stages=stages, options=ExportOptions(weights="fp32", group_size=16))
    reference = tiny_export(FAMILY, stages)
    ours, theirs = load_manifest(out), load_manifest(reference)
    assert [(s.first_layer, s.last_layer) for s in ours.stages] == [(s.first_layer, s.last_layer)
                                                                    for s in theirs.stages]
    for mine, ref in zip(ours.stages, theirs.stages, strict=True):
        assert mine.moe == ref.moe
        bins = [(f.path, r.path) for f, r in zip(mine.files, ref.files, strict=True) if f.path.endswith(".bin")]
        assert bins
        for a, b in bins:
            assert (out / a).read_bytes() == (reference / b).read_bytes(), a
    tokens = greedy_generate(LocalChain.load(out, exact=True), PROMPT_IDS, 12, ignore_eos=True).tokens
    assert len(set(tokens)) > 4, "the random model must not repeat one token, or identity proves nothing"
    assert tokens == greedy_generate(LocalChain.load(reference, exact=True), PROMPT_IDS, 12, ignore_eos=True).tokens


@pytest.mark.parametrize("kind,code_type", [("Q8_0", "i8"), ("Q4_0", "i4"), ("Q4_1", "u4")])
def test_keep_keeps_each_experts_blocks_in_one_stack(tiny_checkpoint, tmp_path, kind, code_type):
    """``gguf_keep`` on a layer's experts: one [experts, out, in / 32, 32] code constant holding each
    expert's own blocks, decompressing to gguf's values of that expert (Q4_1 within the f16 rounding
    of its zero point, as for dense tensors: tests/export/weights/test_weights_gguf_keep.py)."""
    import openvino as ov
    import openvino.opset13 as ops

    from export.weights.stage_weights import StageWeights, WeightMode
    from tests.export.weights.lowering_helpers import run

    path = tmp_path / f"{kind}.gguf"
    write_qwen3moe_gguf(tiny_checkpoint(FAMILY), path, expert_type=kind)
    names = [f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(EXPERTS)]
    with GGUFSource(path) as source, StageWeights(source, WeightMode("gguf_keep")) as weights:
        rows, cols = source.shape(names[0])
        x = ops.parameter([EXPERTS, -1, cols], np.float32, name="x")
        model = ov.Model([ops.matmul(x, weights.stacked(names), False, True)], [x])  # [E, T, rows]
        codes = [op for op in model.get_ordered_ops() if op.get_type_name() == "Constant"
                 and op.get_output_element_type(0) == getattr(ov.Type, code_type)]
        assert [tuple(op.get_output_shape(0)) for op in codes] == [(EXPERTS, rows, cols // 32, 32)]
        eye = np.broadcast_to(np.eye(cols, dtype=np.float32), (EXPERTS, cols, cols)).copy()
        got = run(model, eye)  # each expert's weight, transposed
        for e, name in enumerate(names):
            want = source.read(name)  # gguf's dequantisation of expert e alone
            tolerance = float(np.abs(want).max()) * 2.0 ** -10 if kind == "Q4_1" else 0.0
            np.testing.assert_allclose(got[e].T, want, rtol=0, atol=tolerance, err_msg=name)


@pytest.mark.slow
def test_keep_mode_exports_a_quantised_moe_gguf(tiny_checkpoint, tmp_path):
    """``--weights keep`` on Q8_0 experts: the dense tensors and the stacked experts keep their
    blocks (i8 codes, no re-quantisation); the tokens are those of the same GGUF dequantised to fp32."""
    import openvino as ov

    from export.exporter import ExportOptions, export_model

    path = tmp_path / "q8.gguf"
    write_qwen3moe_gguf(tiny_checkpoint(FAMILY), path, expert_type="Q8_0")
    tokens = {}
    for weights in ("keep", "fp32"):
        export_model(path, tmp_path / weights, stages=2, options=ExportOptions(weights=weights))
        tokens[weights] = greedy_generate(LocalChain.load(tmp_path / weights, exact=True), PROMPT_IDS, 12,
                                          ignore_eos=True).tokens
    stage = load_manifest(tmp_path / "keep").stages[0]
    assert stage.moe is not None
    model = ov.Core().read_model(tmp_path / "keep" / stage.xml)
    kept = {tuple(op.get_output_shape(0)) for op in model.get_ordered_ops()
            if op.get_type_name() == "Constant" and op.get_output_element_type(0) == ov.Type.i8}
    assert {(EXPERTS, 32, 2, 32), (EXPERTS, 64, 1, 32)} <= kept  # gate/up [E, 32, 64] and down [E, 64, 32]
    assert tokens["keep"] == tokens["fp32"]


def test_moe_tensors_in_a_llama_gguf_are_still_refused(tmp_path):
    """Stacked experts are mapped for qwen3moe only: in a llama GGUF they are a Mixtral, not built."""
    from tests.support import llama_gguf

    path = tmp_path / "mixtral-ish.gguf"
    llama_gguf.write_llama_gguf(path, {}, extra={"blk.0.ffn_up_exps.weight": np.ones((2, 96, 64), np.float32)})
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_up_exps\.weight"):
        GGUFSource(path)


def test_an_unknown_gguf_architecture_is_refused_before_any_work(tmp_path):
    import gguf

    from export.exporter import ExportError, ExportOptions, export_model

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "out"
    supported = ", ".join(sorted(GGUF_ARCHITECTURES))
    with pytest.raises(ExportError, match=rf"architecture 'gpt2'.*supported GGUF architectures: {supported}"):
        export_model(path, out, stages=1, options=ExportOptions(weights="fp32"), fingerprint="x")
    assert not out.exists()
