"""Round-to-nearest weight quantisation in numpy, value for value what ``nncf.compress_weights``
(RTN, no dataset) stores, without importing NNCF (which imports torch).

Scales and zero points are computed per output row, over the input dimension (``[out, in]``
weights, the layout of ``MatMul(x, w, transpose_b=True)`` and of an embedding table), or per
group of ``group_size`` consecutive inputs. Rows are independent, so a tensor can be quantised
in row blocks (an 8B model's 2 GB embedding never needs to be whole in f32) and the blocks
concatenate to the whole-tensor result.

NNCF's rules, as it applies them (``weight_lowering.py`` and its OpenVINO-compiled twin, which
it uses for tensors of 10,000 elements or more; both divide, round half to even and clip the
same way, and the tests check both sizes against NNCF itself):

- asymmetric, b bits: ``lo = min(0, min(w))``, ``hi = max(0, max(w))``,
  ``scale = (hi - lo) / (2**b - 1)`` (f32; below f32 eps becomes eps),
  ``zp = clip(-round(lo / scale), 0, 2**b - 1)``, ``q = clip(round(w / scale + zp), 0, 2**b - 1)``;
- symmetric, b bits: ``scale = |min(w)|`` if ``|min(w)| >= max(w)`` else ``-max(w)``, divided
  by ``2**(b-1)`` (so the scale can be negative), eps as above, ``q = clip(round(w / scale),
  -2**(b-1), 2**(b-1) - 1)``;
- the stored scale is that f32 scale rounded to f16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import DeskfleetError

_EPS = np.finfo(np.float32).eps


class GroupSizeError(DeskfleetError):
    """An INT4 group size does not divide a weight's input dimension."""


@dataclass(frozen=True)
class Scheme:
    bits: int
    symmetric: bool
    group_size: int | None  # None: one scale per output row

    @property
    def low(self) -> int:
        return -(2 ** (self.bits - 1)) if self.symmetric else 0

    @property
    def high(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 2**self.bits - 1


SCHEMES = {
    "int4_sym": lambda g: Scheme(4, True, g),
    "int4_asym": lambda g: Scheme(4, False, g),
    "int8_asym": lambda g: Scheme(8, False, None),
}


def scheme_for(kind: str, group_size: int) -> Scheme:
    return SCHEMES[kind](group_size)


@dataclass(frozen=True)
class Quantized:
    """One quantised row block.

    ``values``: int8 (symmetric) or uint8 (asymmetric) codes, ``[rows, in / g, g]`` when grouped
    else ``[rows, in]``; ``scale``: f16, ``[rows, in / g, 1]`` or ``[rows, 1]``; ``zero_point``:
    uint8 of the scale's shape, or ``None`` (symmetric); ``scale_f32``: the unrounded scale.
    """

    values: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    scale_f32: np.ndarray

    def dequantize(self) -> np.ndarray:
        """f32 ``[rows, in]``: ``(code - zero point) * f16 scale``, exactly.

        The product of a code of at most 8 bits and an f16 scale is exact in f32, and that is what
        the CPU plugin's compressed MatMul computes (the graph's nominal f16 Multiply would round).
        """
        codes = self.values.astype(np.float32)
        if self.zero_point is not None:
            codes = codes - self.zero_point.astype(np.float32)
        out = codes * self.scale.astype(np.float32)
        return out.reshape(out.shape[0], -1)


def grouped_shape(shape: tuple[int, int], scheme: Scheme) -> tuple[int, ...]:
    rows, cols = shape
    if scheme.group_size is None:
        return (rows, cols)
    if cols % scheme.group_size:
        raise GroupSizeError(
            f"INT4 group size {scheme.group_size} does not divide the input dimension {cols}; "
            "choose a group size that divides every hidden/intermediate size (e.g. 32 or 64)")
    return (rows, cols // scheme.group_size, scheme.group_size)


def quantize(weight: np.ndarray, scheme: Scheme) -> Quantized:
    """Quantise an f32 ``[rows, in]`` block (rows are output channels / vocabulary entries)."""
    if weight.ndim != 2:
        raise ValueError(f"quantize expects a 2-D [out, in] block, got shape {list(weight.shape)}")
    w = np.asarray(weight, dtype=np.float32).reshape(grouped_shape(weight.shape, scheme))
    low = np.min(w, axis=-1, keepdims=True)
    high = np.max(w, axis=-1, keepdims=True)
    if scheme.symmetric:
        magnitude = np.abs(low)
        scale = np.where(magnitude >= high, magnitude, -high)
        scale = scale / np.float32(-scheme.low)
        scale = np.where(np.abs(scale) < _EPS, _EPS, scale).astype(np.float32)
        codes = np.round(w / scale)
        values = np.clip(codes, scheme.low, scheme.high).astype(np.int8)
        return Quantized(values, scale.astype(np.float16), None, scale)
    low = np.minimum(np.float32(0), low)
    high = np.maximum(np.float32(0), high)
    scale = ((high - low) / np.float32(scheme.high - scheme.low)).astype(np.float32)
    scale = np.where(np.abs(scale) < _EPS, _EPS, scale).astype(np.float32)
    zero_point = np.clip(np.float32(scheme.low) - np.round(low / scale), scheme.low, scheme.high)
    codes = np.round(w / scale + zero_point)
    values = np.clip(codes, scheme.low, scheme.high).astype(np.uint8)
    return Quantized(values, scale.astype(np.float16), zero_point.astype(np.uint8), scale)


def row_block(rows: int, cols: int, block_bytes: int = 8 * 1024 * 1024) -> int:
    """Rows per block so that one f32 block is about ``block_bytes`` (numpy's temporaries while
    quantising it take about four times that)."""
    return max(1, min(rows, block_bytes // max(1, 4 * cols)))
