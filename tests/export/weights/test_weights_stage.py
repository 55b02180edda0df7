"""export.weights.stage_weights: weight subgraphs compute the right weight and stay compressed."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from export.weights.stage_weights import StageWeights, WeightMode, WeightModeError, kind_for
from tests.export.weights.lowering_helpers import ArraySource, matmul_model, run, runtime_weight_precisions


@pytest.fixture(scope="module")
def tensors():
    rng = np.random.default_rng(1)
    return {
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((48, 64)).astype(np.float32),
        "lm_head.weight": rng.standard_normal((40, 64)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(64).astype(np.float32),
    }


def test_fp32_is_the_weight_itself(tensors):
    name = "model.layers.0.mlp.up_proj.weight"
    with StageWeights(ArraySource(tensors), WeightMode("fp32")) as weights:
        model = matmul_model(weights.linear(name), 64)
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_allclose(run(model, x), x @ tensors[name].T, rtol=1e-5, atol=1e-5)


def test_fp16_rounds_to_half_and_stays_half_on_the_cpu(tensors):
    name = "model.layers.0.mlp.up_proj.weight"
    with StageWeights(ArraySource(tensors), WeightMode("fp16")) as weights:
        out = weights.linear(name)
        model = matmul_model(out, 64)
    assert out.get_node().get_type_name() == "Convert"
    assert out.get_node().input_value(0).get_element_type() == ov.Type.f16
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    half = tensors[name].astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(run(model, x), x @ half.T, rtol=1e-5, atol=1e-5)
    # The marked Convert is not folded: the compiled model holds the f16 weight, not an f32 copy.
    assert runtime_weight_precisions(model).count("f16") == 1


def test_vector_is_an_f32_constant(tensors):
    with StageWeights(ArraySource(tensors), WeightMode("int4_sym")) as weights:
        out = weights.vector("model.norm.weight")
        with pytest.raises(WeightModeError, match="1-D"):
            weights.vector("lm_head.weight")
    assert out.get_element_type() == ov.Type.f32
    np.testing.assert_array_equal(out.get_node().get_data(), tensors["model.norm.weight"])


def test_the_same_tensor_gives_the_same_node(tensors):
    with StageWeights(ArraySource(tensors), WeightMode("fp16")) as weights:
        assert weights.linear("lm_head.weight").get_node() is weights.embedding("lm_head.weight").get_node()


def test_lowering_depends_on_what_the_weight_is_not_on_the_stage():
    assert kind_for("model.layers.17.self_attn.q_proj.weight", WeightMode("int4_asym")) == "int4_asym"
    assert kind_for("model.embed_tokens.weight", WeightMode("int4_sym")) == "int8_asym"
    assert kind_for("lm_head.weight", WeightMode("int4_sym")) == "int8_asym"
    assert kind_for("lm_head.weight", WeightMode("fp16")) == "fp16"
    with pytest.raises(WeightModeError, match="unknown"):
        WeightMode("int3")


INT_CASES = [("int4_sym", 16), ("int4_asym", 16), ("int8_asym", 64)]
NNCF_MODE = {"int4_sym": "INT4_SYM", "int4_asym": "INT4_ASYM", "int8_asym": "INT8_ASYM"}


def nncf_compressed(weight: np.ndarray, kind: str, group_size: int) -> ov.Model:
    import nncf

    model = matmul_model(ops.constant(weight, name="W").output(0), weight.shape[1])
    extra = dict(group_size=group_size, ratio=1.0, all_layers=True) if kind.startswith("int4") else {}
    return nncf.compress_weights(model, mode=getattr(nncf.CompressWeightsMode, NNCF_MODE[kind]), **extra)


def op_types(model: ov.Model) -> list[tuple[str, str]]:
    return [(op.get_type_name(), op.get_output_element_type(0).get_type_name()) for op in model.get_ordered_ops()]


@pytest.fixture(scope="module")
def big_weight():
    # 40,960 elements: NNCF lowers it through its OpenVINO-compiled path.
    rng = np.random.default_rng(4)
    return {"model.layers.3.self_attn.o_proj.weight": rng.standard_normal((320, 128)).astype(np.float32)}


@pytest.mark.parametrize("kind,group_size", INT_CASES)
@pytest.mark.parametrize("file_backed", [False, True], ids=["memory", "weight-file"])
def test_integer_subgraph_is_nncfs_and_computes_its_matmul(kind, group_size, file_backed, big_weight, tmp_path):
    from export.weights.rtn import quantize, scheme_for

    name = next(iter(big_weight))
    w = big_weight[name]
    bin_path = tmp_path / "stage.weights" if file_backed else None
    with StageWeights(ArraySource(big_weight), WeightMode(kind, group_size), bin_path=bin_path) as weights:
        ours = matmul_model(weights.linear(name), w.shape[1])
    if file_backed:
        assert not bin_path.exists()  # the scratch file is gone; its mapping lives on in the constants
    reference = nncf_compressed(w, kind, group_size)
    assert op_types(ours) == op_types(reference)
    x = np.random.default_rng(6).standard_normal((5, w.shape[1])).astype(np.float32)
    got = run(ours, x)
    # Same constants, same graph: the compiled outputs agree exactly with NNCF's model ...
    np.testing.assert_array_equal(got, run(reference, x))
    # ... and with the numpy dequantisation, up to f32 summation order.
    dequantized = quantize(w, scheme_for(kind, group_size)).dequantize()
    np.testing.assert_allclose(got, x @ dequantized.T, rtol=1e-4, atol=1e-4)
    code_type = {"int4_sym": "i4", "int4_asym": "u4", "int8_asym": "u8"}[kind]
    assert code_type in runtime_weight_precisions(ours)  # the CPU runs it compressed


def test_int4_stage_keeps_the_head_and_embedding_at_int8(tensors):
    with StageWeights(ArraySource(tensors), WeightMode("int4_asym", 16)) as weights:
        head = weights.linear("lm_head.weight")
        table = weights.embedding("lm_head.weight")
        layer = weights.linear("model.layers.0.mlp.up_proj.weight")

    def code_type(out):
        node = out.get_node()
        while node.get_type_name() != "Constant":
            node = node.input_value(0).get_node()
        return node.get_output_element_type(0).get_type_name()

    assert head.get_node() is table.get_node()
    assert code_type(head) == "u8" and code_type(layer) == "u4"


def test_embedding_gather_stays_compressed_on_the_cpu(tensors):
    table = tensors["lm_head.weight"]
    with StageWeights(ArraySource(tensors), WeightMode("int8_asym")) as weights:
        ids = ops.parameter([-1], np.int64, name="ids")
        model = ov.Model([ops.gather(weights.embedding("lm_head.weight"), ids, 0)], [ids])
    from export.weights.rtn import quantize, scheme_for

    want = quantize(table, scheme_for("int8_asym", 0)).dequantize()
    picked = np.array([0, 39, 7, 7], np.int64)
    np.testing.assert_allclose(run(model, picked), want[picked], rtol=1e-6, atol=1e-6)
    assert "u8" in runtime_weight_precisions(model)


def test_row_blocks_give_the_whole_tensor_result(big_weight, tmp_path, monkeypatch):
    import export.weights.stage_weights as sw

    name = next(iter(big_weight))
    with StageWeights(ArraySource(big_weight), WeightMode("int4_asym", 32)) as weights:
        whole = weights.linear(name)
        x = np.random.default_rng(8).standard_normal((2, 128)).astype(np.float32)
        want = run(matmul_model(whole, 128), x)
    monkeypatch.setattr(sw, "row_block", lambda rows, cols: 7)  # 320 rows in 46 blocks, the last short
    with StageWeights(ArraySource(big_weight), WeightMode("int4_asym", 32), bin_path=tmp_path / "w") as weights:
        np.testing.assert_array_equal(run(matmul_model(weights.linear(name), 128), x), want)


def test_file_backed_constants_save_after_close_and_read_back(big_weight, tmp_path):
    name = next(iter(big_weight))
    with StageWeights(ArraySource(big_weight), WeightMode("int4_sym", 32), bin_path=tmp_path / "scratch") as weights:
        model = matmul_model(weights.linear(name), 128)
    x = np.random.default_rng(9).standard_normal((3, 128)).astype(np.float32)
    want = run(model, x)
    ov.save_model(model, tmp_path / "m.xml", compress_to_fp16=False)
    del model
    np.testing.assert_array_equal(run(ov.Core().read_model(tmp_path / "m.xml"), x), want)
    # 320 x 128 4-bit codes + 320 x 4 f16 scales (+ the reshape target): nothing was widened.
    assert (tmp_path / "m.bin").stat().st_size < 320 * 128 // 2 + 320 * 4 * 2 + 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin", "m.xml"]
