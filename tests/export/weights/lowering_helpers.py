"""What the weight-lowering tests share: an in-memory TensorSource, a one-MatMul model around a
lowered weight, and running or inspecting it on the CPU with exact settings."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

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
