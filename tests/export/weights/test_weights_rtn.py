"""export.weights.rtn against the oracle: nncf.compress_weights (RTN) on the same tensor.

NNCF quantises tensors under 10,000 elements in numpy and larger ones through an OpenVINO-compiled
model (its default), so every mode is checked at both sizes, on random data and on rows built to
hit the edge cases (all zero, one sign only, exact .5 ties, tiny values).
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from export.weights.rtn import GroupSizeError, quantize, row_block, scheme_for

SMALL = (48, 64)  # 3,072 elements: NNCF's numpy path
LARGE = (320, 128)  # 40,960 elements: NNCF's OpenVINO-compiled path
NNCF_MODES = {"int4_sym": "INT4_SYM", "int4_asym": "INT4_ASYM", "int8_asym": "INT8_ASYM"}


def unpack_nibbles(packed: np.ndarray, signed: bool) -> np.ndarray:
    """OpenVINO's u4/i4 storage: two values a byte, the first in the low nibble."""
    packed = packed.reshape(-1).view(np.uint8)
    both = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(-1)
    if signed:
        return np.where(both >= 8, both.astype(np.int16) - 16, both).astype(np.int8)
    return both


def constant_values(node: ov.Node) -> np.ndarray:
    kind = node.get_element_type().get_type_name()
    shape = list(node.get_output_shape(0))
    data = node.get_data()
    if kind in ("u4", "i4"):
        return unpack_nibbles(data, signed=kind == "i4")[: int(np.prod(shape))].reshape(shape)
    return np.asarray(data).reshape(shape)


def nncf_lowering(weight: np.ndarray, kind: str, group_size: int, embedding: bool = False):
    """(codes, f16 scale, zero point or None) of ``weight`` as NNCF stores it."""
    import nncf

    rows, cols = weight.shape
    if embedding:
        ids = ops.parameter([-1], np.int64, name="ids")
        out = ops.gather(ops.constant(weight, name="W"), ids, 0)
        model = ov.Model([ops.matmul(out, ops.constant(np.ones((cols, 4), np.float32)), False, False)], [ids])
    else:
        x = ops.parameter([-1, cols], np.float32, name="x")
        model = ov.Model([ops.matmul(x, ops.constant(weight, name="W"), False, True)], [x])
    extra = dict(group_size=group_size, ratio=1.0, all_layers=True) if kind.startswith("int4") else {}
    model = nncf.compress_weights(model, mode=getattr(nncf.CompressWeightsMode, NNCF_MODES[kind]), **extra)
    found = {op.get_friendly_name(): op for op in model.get_ordered_ops() if op.get_type_name() == "Constant"}
    codes = constant_values(found["W"])
    zero = constant_values(found["W/zero_point"]) if "W/zero_point" in found else None
    return codes, found["W/scale"].get_data().copy(), zero


def edge_rows(cols: int) -> np.ndarray:
    ramp = np.arange(cols, dtype=np.float32)
    return np.stack([
        np.zeros(cols, np.float32),  # scale falls to eps
        np.abs(np.sin(ramp)) + 0.1,  # positive only: asym low clamps to 0
        -(np.abs(np.cos(ramp)) + 0.1),  # negative only
        (ramp % 16) * 0.25 - 2.0,  # many codes land exactly on .5 ties
        np.full(cols, 1e-9, np.float32) * (ramp - cols / 2),  # below f32 eps: scale clamps
        np.where(ramp % 2 == 0, 3.0, -3.0).astype(np.float32),  # |min| == max: sym picks |min|
    ])


def weights_of(shape, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 2.0, (shape[0], 1)).astype(np.float32)
    w[: edge_rows(shape[1]).shape[0]] = edge_rows(shape[1])
    return w


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["numpy-path", "compiled-path"])
@pytest.mark.parametrize("kind,group_size", [("int4_sym", 16), ("int4_asym", 32), ("int8_asym", 0)])
def test_matmul_weights_are_bit_identical_to_nncf(shape, kind, group_size):
    w = weights_of(shape, seed=hash((shape, kind)) % 1000)
    codes, scale, zero = nncf_lowering(w, kind, group_size)
    ours = quantize(w, scheme_for(kind, group_size))
    assert ours.values.shape == codes.shape and ours.scale.shape == scale.shape
    np.testing.assert_array_equal(ours.values, codes)
    np.testing.assert_array_equal(ours.scale.view(np.uint16), scale.view(np.uint16))
    if kind.endswith("asym"):
        np.testing.assert_array_equal(ours.zero_point, zero)
    else:
        assert zero is None and ours.zero_point is None
        assert ours.values.dtype == np.int8 and ours.values.min() >= -8 and ours.values.max() <= 7


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["numpy-path", "compiled-path"])
def test_embedding_int8_is_bit_identical_to_nncf(shape):
    w = weights_of(shape, seed=7)
    codes, scale, zero = nncf_lowering(w, "int8_asym", 0, embedding=True)
    ours = quantize(w, scheme_for("int8_asym", 0))
    np.testing.assert_array_equal(ours.values, codes)
    np.testing.assert_array_equal(ours.scale.view(np.uint16), scale.view(np.uint16))
    np.testing.assert_array_equal(ours.zero_point, zero)


def test_row_blocks_concatenate_to_the_whole_tensor():
    w = weights_of(LARGE, seed=3)
    scheme = scheme_for("int4_asym", 32)
    whole = quantize(w, scheme)
    parts = [quantize(w[i:i + 37], scheme) for i in range(0, w.shape[0], 37)]
    np.testing.assert_array_equal(np.concatenate([p.values for p in parts]), whole.values)
    np.testing.assert_array_equal(np.concatenate([p.scale for p in parts]), whole.scale)
    np.testing.assert_array_equal(np.concatenate([p.zero_point for p in parts]), whole.zero_point)
    assert 1 <= row_block(128256, 4096) < 128256


def test_dequantize_is_close_to_the_weight():
    w = np.random.default_rng(5).standard_normal((16, 64)).astype(np.float32)
    for kind in NNCF_MODES:
        q = quantize(w, scheme_for(kind, 16))
        step = np.abs(q.scale_f32).max()
        # Asymmetric codes round to the nearest step; symmetric ones also clip the far end by one step.
        bound = step * (1.01 if kind.endswith("_sym") else 0.51) + np.abs(w).max() * 2e-3  # + f16 scale rounding
        assert np.abs(q.dequantize() - w).max() <= bound


def test_a_group_size_that_does_not_divide_is_explained():
    with pytest.raises(GroupSizeError, match="does not divide the input dimension 576"):
        quantize(np.zeros((4, 576), np.float32), scheme_for("int4_sym", 128))
