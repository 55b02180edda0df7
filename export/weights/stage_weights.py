"""One stage's weights as OpenVINO subgraphs: read → quantise → constant → release.

Every weight is lowered by a rule that depends only on what the weight is, never on the stage it
sits in (the two-pass rule of :mod:`export.compress`): in an INT4 export the decoder layers'
matrices are INT4 and everything outside them (embedding, LM head) INT8 asymmetric per channel,
so an N-stage INT4 export holds exactly the values of the 1-stage one.

The subgraphs are the ones NNCF / ``ov.save_model(compress_to_fp16=True)`` emit, which the
CPU/GPU plugins keep compressed at run time::

    fp16:      f16 Constant ─ Convert f32 (marked "decompression")
    int8_asym: u8 [out, in] ─ Convert f16 ─ Subtract(u8 zp [out,1] ─ Convert f16) ─ Multiply(f16 scale [out,1]) ─ Convert f32
    int4_asym: u4 [out, in/g, g] ─ Convert f16 ─ Subtract(u4 zp [out, in/g, 1] ─ Convert f16) ─ Multiply(f16 scale) ─ Reshape [out, in] ─ Convert f32
    int4_sym:  i4 [out, in/g, g] ─ Convert f16 ─ Multiply(f16 scale [out, in/g, 1]) ─ Reshape [out, in] ─ Convert f32
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from engine.errors import DeskfleetError
from export.weights.checkpoint import TensorSource

KINDS = ("int4_sym", "int4_asym", "int8_asym", "fp16", "fp32")
_DECODER = re.compile(r"(^|\.)layers\.\d+\.")


class WeightModeError(DeskfleetError):
    """A weight mode is unknown, or its group size does not divide a weight's input dimension."""


@dataclass(frozen=True)
class WeightMode:
    kind: str  # one of KINDS
    group_size: int = 64  # INT4 only: values per scale along the input dimension

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise WeightModeError(f"unknown weight mode {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.kind.startswith("int4") and self.group_size <= 0:
            raise WeightModeError(f"INT4 group size must be positive, got {self.group_size}")


# What the non-decoder weights (embedding, LM head) become under each stage mode.
_OUTSIDE_DECODER: dict[str, str] = {
    "int4_sym": "int8_asym",
    "int4_asym": "int8_asym",
    "int8_asym": "int8_asym",
    "fp16": "fp16",
    "fp32": "fp32",
}


def kind_for(name: str, mode: WeightMode) -> str:
    """The lowering of matrix ``name`` under ``mode`` (decoder matrices take the mode itself)."""
    return mode.kind if _DECODER.search(name) else _OUTSIDE_DECODER[mode.kind]


@functools.lru_cache(maxsize=1)
def _decompression_attribute() -> tuple[str, object] | None:
    """The typed ``decompression`` rt_info value that keeps a f16→f32 Convert from being folded.

    Python cannot construct it, so it is taken from a one-element model that OpenVINO's own fp16
    compression (what ``save_model(compress_to_fp16=True)`` runs) has marked.
    """
    try:
        from openvino._offline_transformations import compress_model_transformation
    except ImportError:  # pragma: no cover - an OpenVINO without it: the Convert just folds
        return None
    probe = ov.Model([ops.convert(ops.constant(np.ones(1, np.float32)), "f32")], [])
    compress_model_transformation(probe)
    for node in probe.get_ordered_ops():
        info = node.get_rt_info()
        for key in ("decompression_0", "decompression"):
            if key in info:
                return key, info[key]
    return None  # pragma: no cover


def mark_decompression(node: ov.Node) -> None:
    found = _decompression_attribute()
    if found is not None:
        key, attribute = found
        node.set_rt_info(attribute, key)


class StageWeights:
    """Builds one stage's weight subgraphs from a :class:`TensorSource`; a context manager.

    ``linear`` / ``embedding`` return the same node when asked twice for one tensor (a tied head
    and its embedding share one compressed constant, as in the traced graph NNCF saw).
    """

    def __init__(self, source: TensorSource, mode: WeightMode, bin_path: Path | None = None):
        self.source = source
        self.mode = mode
        self.bin_path = bin_path
        self._built: dict[tuple[str, str], ov.Output] = {}

    def __enter__(self) -> StageWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._built.clear()

    # -- public --------------------------------------------------------------------------

    def linear(self, name: str) -> ov.Output:
        """f32 ``[out, in]`` weight for ``MatMul(x, w, transpose_b=True)``."""
        return self._matrix(name, kind_for(name, self.mode))

    def embedding(self, name: str) -> ov.Output:
        """f32 ``[vocab, hidden]`` table for ``Gather(table, ids, axis=0)``."""
        return self._matrix(name, kind_for(name, self.mode))

    def vector(self, name: str) -> ov.Output:
        """f32 1-D constant (norm gammas, biases), stored as read."""
        values = self.source.read(name)
        if values.ndim != 1:
            raise WeightModeError(f"{name} has shape {list(values.shape)}; vector() expects a 1-D tensor")
        return self._constant(values, name)

    # -- lowering ------------------------------------------------------------------------

    def _matrix(self, name: str, kind: str) -> ov.Output:
        key = (name, kind)
        if key not in self._built:
            shape = self.source.shape(name)
            if len(shape) != 2:
                raise WeightModeError(f"{name} has shape {list(shape)}; a matrix weight must be 2-D")
            self._built[key] = getattr(self, f"_lower_{kind}")(name, shape)
        return self._built[key]

    def _lower_fp32(self, name: str, shape: tuple[int, ...]) -> ov.Output:
        return self._constant(self.source.read(name), name)

    def _lower_fp16(self, name: str, shape: tuple[int, ...]) -> ov.Output:
        half = self.source.read(name).astype(np.float16)
        convert = ops.convert(self._constant(half, name), "f32", name=f"{name}/decompress")
        mark_decompression(convert)
        return convert.output(0)

    def _constant(self, values: np.ndarray, name: str) -> ov.Output:
        const = ops.constant(values, name=name)
        return const.output(0)
