"""GGUF keep mode: Q8_0 / Q4_0 / Q4_1 blocks become decompression constants without re-rounding,
and decompress to gguf's own dequantisation (exactly for Q8_0 and Q4_0; Q4_1 within the f16
rounding of its zero point)."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from export.weights.gguf_blocks import decode
from export.weights.gguf_source import GGUFSource
from export.weights.stage_weights import StageWeights, WeightMode, WeightModeError
from tests.export.weights.lowering_helpers import (
    ArraySource,
    matmul_model,
    run,
    runtime_weight_precisions,
)
from tests.support.llama_gguf import MIXED, write_llama_gguf


def gguf_blocks_of(values: np.ndarray, type_name: str) -> np.ndarray:
    import gguf

    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])


def gguf_dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])


def weights(rows=24, cols=128, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 3, (rows, 1)).astype(np.float32)
    w[0] = 0.0  # all-zero blocks
    w[1, :32] = 0.75  # a constant block: Q4_1 scale 0, offset 0.75
    w[2] = np.abs(w[2]) + 5.0  # large positive offsets
    return w


@pytest.mark.parametrize("type_name,code_type", [("Q8_0", "i8"), ("Q4_0", "i4")])
def test_symmetric_blocks_decompress_exactly(type_name, code_type):
    raw = gguf_blocks_of(weights(), type_name)
    block = decode(type_name, raw)
    assert block.code_type == code_type and block.zero_point is None
    assert block.codes.shape == (24, 4, 32) and block.scale.shape == (24, 4, 1)
    np.testing.assert_array_equal(block.dequantize(), gguf_dequantize(raw, type_name))
    if code_type == "i4":
        assert block.codes.min() >= -8 and block.codes.max() <= 7


def test_q4_1_decompresses_within_the_f16_rounding_of_its_zero_point():
    raw = gguf_blocks_of(weights(), "Q4_1")
    block = decode("Q4_1", raw)
    want = gguf_dequantize(raw, "Q4_1")
    m = raw.reshape(24, 4, 20)[..., 2:4].copy().view(np.float16).astype(np.float32)
    bound = np.repeat(np.abs(m) * 2.0**-11, 32, axis=-1).reshape(24, 128) + 1e-7
    assert block.code_type == "u4" and block.zero_point.dtype == np.float16
    assert (np.abs(block.dequantize() - want) <= bound).all()
    np.testing.assert_array_equal(block.dequantize()[1, :32], want[1, :32])  # the constant block: exact
    assert block.codes.max() <= 15


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("keep") / "tiny.gguf"
    write_llama_gguf(path, MIXED, seed=4)
    return GGUFSource(path)


def first_constant_type(out: ov.Output) -> str:
    node = out.get_node()
    while node.get_type_name() != "Constant":
        node = node.input_value(0).get_node()
    return node.get_output_element_type(0).get_type_name()


@pytest.mark.parametrize("name,code_type", [
    ("model.layers.0.self_attn.q_proj.weight", "i4"),  # Q4_0, rows un-permuted
    ("model.layers.1.self_attn.k_proj.weight", "u4"),  # Q4_1, rows un-permuted
    ("model.layers.0.self_attn.v_proj.weight", "i8"),  # Q8_0
    ("model.layers.1.mlp.down_proj.weight", "u4"),  # Q4_1
    ("model.layers.0.self_attn.o_proj.weight", "f16"),  # F16: fp16 pattern
    ("lm_head.weight", "i8"),
])
def test_kept_matmuls_compute_the_gguf_weights_and_stay_compressed(tiny_gguf, name, code_type, tmp_path):
    with StageWeights(tiny_gguf, WeightMode("gguf_keep"), bin_path=tmp_path / "scratch") as stage:
        out = stage.linear(name)
        model = matmul_model(out, tiny_gguf.shape(name)[1])
    assert first_constant_type(out) == code_type
    x = np.random.default_rng(1).standard_normal((3, tiny_gguf.shape(name)[1])).astype(np.float32)
    got = run(model, x)
    gguf_values = tiny_gguf.read(name)  # gguf's dequantisation, rows un-permuted
    if tiny_gguf.type_name(name) == "Q4_1":
        raw = tiny_gguf.blocks(name).data
        order = tiny_gguf.row_order(name)
        kept = decode("Q4_1", raw if order is None else raw[order])
        np.testing.assert_allclose(got, x @ kept.dequantize().T, rtol=1e-4, atol=1e-4)
        # ... which is gguf's value up to the f16 rounding of each block's zero point.
        m = np.abs(kept.zero_point.astype(np.float32) * kept.scale.astype(np.float32))
        bound = np.repeat(m * 2.0**-11, 32, axis=-1).reshape(gguf_values.shape)
        assert (np.abs(got - x @ gguf_values.T) <= np.abs(x) @ bound.T + 1e-4).all()
    else:
        np.testing.assert_allclose(got, x @ gguf_values.T, rtol=1e-4, atol=1e-4)
    assert code_type in runtime_weight_precisions(model)


def test_q8_0_embedding_is_a_grouped_i8_gather(tiny_gguf):
    with StageWeights(tiny_gguf, WeightMode("gguf_keep")) as stage:
        ids = ops.parameter([-1], np.int64, name="ids")
        model = ov.Model([ops.gather(stage.embedding("model.embed_tokens.weight"), ids, 0)], [ids])
    picked = np.array([0, 5, 319, 5], np.int64)
    np.testing.assert_array_equal(run(model, picked), tiny_gguf.read("model.embed_tokens.weight")[picked])
    assert "i8" in runtime_weight_precisions(model)


def test_keep_needs_a_gguf():
    source = ArraySource({"model.layers.0.mlp.up_proj.weight": np.ones((4, 32), np.float32)})
    with StageWeights(source, WeightMode("gguf_keep")) as stage, pytest.raises(WeightModeError, match="not a GGUF"):
        stage.linear("model.layers.0.mlp.up_proj.weight")


def random_k_blocks(type_name: str, rows: int, supers: int, seed: int) -> np.ndarray:
    """Valid K-quant rows: any bytes are valid codes and sub-scales; the f16 super-scales are set
    to sane random values (random bytes could be inf/nan)."""
    size = {"Q4_K": 144, "Q6_K": 210}[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, supers, size), dtype=np.uint8)
    halves = rng.uniform(1e-4, 2e-2, (rows, supers, 2)).astype(np.float16).view(np.uint8).reshape(rows, supers, 4)
    if type_name == "Q4_K":
        blocks[..., 0:4] = halves  # d, dmin
        blocks[0, 0, 4:16] = 0  # a sub-block scale of 0 with offset 0 -> constant blocks
    else:
        blocks[..., 208:210] = halves[..., :2]  # d
    return blocks.reshape(rows, supers * size)


def test_q6_k_decompresses_exactly():
    raw = random_k_blocks("Q6_K", rows=8, supers=3, seed=2)
    block = decode("Q6_K", raw)
    assert block.code_type == "i8" and block.codes.shape == (8, 48, 16) and block.scale.dtype == np.float32
    assert block.codes.min() >= -32 and block.codes.max() <= 31
    np.testing.assert_array_equal(block.dequantize(), gguf_dequantize(raw, "Q6_K"))


def test_q4_k_decompresses_within_f32_rounding():
    raw = random_k_blocks("Q4_K", rows=8, supers=3, seed=3)
    block = decode("Q4_K", raw)
    want = gguf_dequantize(raw, "Q4_K")
    assert block.code_type == "u4" and block.codes.shape == (8, 24, 32) and block.zero_point.dtype == np.float32
    np.testing.assert_allclose(block.dequantize(), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("type_name,code_type", [("Q4_K", "u4"), ("Q6_K", "i8")])
def test_k_quant_matmul_stays_compressed(type_name, code_type, tmp_path):
    class KSource(ArraySource):
        def __init__(self, raw, values):
            super().__init__({"model.layers.0.mlp.up_proj.weight": values})
            self._raw = raw

        def type_name(self, name):
            return type_name

        def blocks(self, name):
            from export.weights.gguf_source import RawBlocks

            return RawBlocks(type_name, self.shape(name), self._raw)

        def row_order(self, name):
            return None

    raw = random_k_blocks(type_name, rows=16, supers=2, seed=5)
    values = gguf_dequantize(raw, type_name).reshape(16, 512)
    name = "model.layers.0.mlp.up_proj.weight"
    with StageWeights(KSource(raw, values), WeightMode("gguf_keep"), bin_path=tmp_path / "w") as stage:
        out = stage.linear(name)
        model = matmul_model(out, 512)
    assert first_constant_type(out) == code_type
    x = np.random.default_rng(0).standard_normal((2, 512)).astype(np.float32)
    np.testing.assert_allclose(run(model, x), x @ values.T, rtol=1e-4, atol=1e-4 * np.abs(x @ values.T).max())
    assert code_type in runtime_weight_precisions(model)
