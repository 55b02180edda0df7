"""GGUF quantisation blocks as OpenVINO decompression constants, without re-rounding.

ggml's legacy block types quantise 32 consecutive inputs of a row with one f16 scale, which is
exactly a group-wise decompression pattern with group size 32:

=======  =====================================  ==============================================
type     block (bytes)                          kept as
=======  =====================================  ==============================================
Q8_0     f16 d, 32 x int8 q      (34)           i8 codes q, f16 scale d (symmetric)
Q4_0     f16 d, 16 bytes of nibbles (18)        i4 codes q - 8, f16 scale d (symmetric)
Q4_1     f16 d, f16 m, 16 bytes of nibbles (20) u4 codes q, f16 scale d, f16 zero point -m/d
=======  =====================================  ==============================================

A block's nibbles hold its first 16 values in the low halves and the last 16 in the high
halves; OpenVINO packs consecutive values into one byte, so codes are re-packed, never
re-rounded. Q8_0 and Q4_0 therefore decompress to exactly gguf's values. Q4_1's offset ``m`` is
not an integer zero point: it becomes an f16 per-group zero point ``z = -m / d`` (an Add after
the Multiply would be folded into f32 weights by the CPU plugin, a Subtract before it keeps the
weight compressed), so a Q4_1 value is ``d * (q - z)``, off gguf's ``d * q + m`` by at most the
f16 rounding of ``z`` (|m| x 2^-11). A block whose scale is 0 holds ``m`` 32 times and is kept
exactly as codes 1, zero point 0, scale ``m`` (so is a block with ``|m / d|`` beyond f16's
range, off by at most ``15 d``).

K-quants group 256 values into a super-block whose sub-block scales are small integers times
an f16 super-scale, so a sub-block's scale ``d * sc`` needs up to 17 significant bits: these
are kept with **f32** scales (and zero points), the pattern's Converts going to f32:

=======  =====================================  ==============================================
Q6_K     256 x 6-bit q, 16 int8 sc, f16 d       i8 codes q - 32, f32 scale d * sc, groups of 16
Q4_K     256 x 4-bit q, 8 x (6-bit sc, 6-bit    u4 codes q, f32 scale d * sc, f32 zero point
         mn), f16 d, f16 dmin                   dmin * mn / (d * sc), groups of 32
=======  =====================================  ==============================================

Q6_K decompresses to exactly gguf's values; Q4_K's ``(q - z) * s`` differs from gguf's
``s * q - dmin * mn`` by f32 rounding only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK_VALUES = 32
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}
KEPT_TYPES = frozenset(_BLOCK_BYTES)


@dataclass(frozen=True)
class BlockCodes:
    """One row block of a kept tensor, in the decompression pattern's terms.

    ``codes``: int8 (``i8``/``i4``) or uint8 (``u4``) ``[rows, in / g, g]`` in logical order
    (g = 32, or 16 for Q6_K); ``scale``: f16 (f32 for K-quants) ``[rows, in / g, 1]``;
    ``zero_point``: of the scale's type and shape, or ``None``.
    """

    code_type: str
    codes: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None

    def dequantize(self) -> np.ndarray:
        """f32 ``[rows, in]`` as the CPU plugin computes the pattern (f32 arithmetic)."""
        values = self.codes.astype(np.float32)
        if self.zero_point is not None:
            values = values - self.zero_point.astype(np.float32)
        out = values * self.scale.astype(np.float32)
        return out.reshape(out.shape[0], -1)


def _split_nibbles(packed: np.ndarray) -> np.ndarray:
    """ggml's 16 bytes of a block -> its 32 codes in order (low nibbles first, then high)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q6_k(blocks: np.ndarray) -> BlockCodes:
    """``blocks``: uint8 ``[rows, super-blocks, 210]``."""
    rows, supers = blocks.shape[:2]
    low = blocks[..., :128].reshape(rows, supers, 2, 2, 32)  # [half, first/second 32 bytes, 32]
    high = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32)  # [half, 1, 32]
    nibbles = np.stack([low & 0x0F, low >> 4], axis=3).reshape(rows, supers, 2, 4, 32)  # k = 2 * shift + part
    crumbs = (high >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
    codes = ((nibbles | (crumbs << 4)).astype(np.int16) - 32).astype(np.int8)
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [rows, supers, 16]
    d = blocks[..., 208:210].copy().view(np.float16).astype(np.float32)  # [rows, supers, 1]
    scale = (d * sc).reshape(rows, supers * 16, 1)
    return BlockCodes("i8", codes.reshape(rows, supers * 16, 16), scale, None)


def _q4_k(blocks: np.ndarray) -> BlockCodes:
    """``blocks``: uint8 ``[rows, super-blocks, 144]``."""
    rows, supers = blocks.shape[:2]
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    a, b, c = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]  # the 12 bytes of 6-bit pairs
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1).astype(np.float32)  # [rows, supers, 8]
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1).astype(np.float32)
    qs = blocks[..., 16:144].reshape(rows, supers, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, supers * 8, 32)
    scale = (d * sc).reshape(rows, supers * 8, 1)
    offset = (dmin * mn).reshape(rows, supers * 8, 1)  # value = scale * q - offset
    flat = scale == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(flat, np.float32(0), offset / np.where(flat, np.float32(1), scale)).astype(np.float32)
    codes = np.where(flat, np.uint8(1), codes).astype(np.uint8)
    scale = np.where(flat, -offset, scale).astype(np.float32)
    return BlockCodes("u4", codes, scale, zero)


def decode(type_name: str, raw: np.ndarray) -> BlockCodes:
    """Decode uint8 rows ``[rows, bytes per row]`` of a Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K tensor."""
    if type_name not in _BLOCK_BYTES:
        raise ValueError(f"GGML type {type_name} has no kept form; kept types: {', '.join(sorted(KEPT_TYPES))}")
    size = _BLOCK_BYTES[type_name]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows = raw.shape[0]
    if raw.shape[-1] % size:
        raise ValueError(f"{type_name} rows of {raw.shape[-1]} bytes are not whole {size}-byte blocks")
    blocks = raw.reshape(rows, -1, size)
    if type_name == "Q6_K":
        return _q6_k(blocks)
    if type_name == "Q4_K":
        return _q4_k(blocks)
    scale = blocks[..., 0:2].copy().view(np.float16)  # [rows, groups, 1]
    if type_name == "Q8_0":
        codes = blocks[..., 2:].copy().view(np.int8)
        return BlockCodes("i8", codes, scale, None)
    if type_name == "Q4_0":
        codes = (_split_nibbles(blocks[..., 2:]).astype(np.int16) - 8).astype(np.int8)
        return BlockCodes("i4", codes, scale, None)
    offset = blocks[..., 2:4].copy().view(np.float16)
    codes = _split_nibbles(blocks[..., 4:])
    d = scale.astype(np.float32)
    m = offset.astype(np.float32)
    # A zero scale, or one so small against the offset that -m/d leaves f16's range: the block
    # is (all but) constant, kept as m itself (off by at most 15 d in the second case).
    flat = (d == 0) | (np.abs(m) > np.abs(d) * np.float32(60000))
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(flat, np.float32(0), -m / np.where(flat, np.float32(1), d)).astype(np.float16)
    scale = np.where(flat, offset, scale).astype(np.float16)
    codes = np.where(flat, np.uint8(1), codes).astype(np.uint8)
    return BlockCodes("u4", codes, scale, zero)
