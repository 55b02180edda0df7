"""export.weights.stage_weights: weight subgraphs compute the right weight and stay compressed."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from export.weights.stage_weights import StageWeights, WeightMode, WeightModeError, kind_for

EXACT = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}


class ArraySource:
    """An in-memory TensorSource (the seam's fake side, for unit tests of the lowering)."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.config: dict = {}
        self._t = tensors

    def names(self):
        return frozenset(self._t)

    def shape(self, name):
        return tuple(self._t[name].shape)

    def read(self, name):
        return self._t[name].astype(np.float32).copy()

    def read_rows(self, name, start, stop):
        return self._t[name][start:stop].astype(np.float32).copy()


def matmul_model(weight: ov.Output, inputs: int) -> ov.Model:
    x = ops.parameter([-1, inputs], np.float32, name="x")
    return ov.Model([ops.matmul(x, weight, False, True)], [x])


def run(model: ov.Model, x: np.ndarray) -> np.ndarray:
    compiled = ov.Core().compile_model(model, "CPU", EXACT)
    return compiled(x)[0]


def runtime_weight_precisions(model: ov.Model) -> list[str]:
    compiled = ov.Core().compile_model(model, "CPU", EXACT)
    return [op.get_rt_info()["outputPrecisions"].astype(str) for op in compiled.get_runtime_model().get_ordered_ops()
            if op.get_rt_info()["layerType"].astype(str) == "Const"]


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
