"""apply_mask and unpack_mask against an independent bit-by-bit reading of the packed layout
(token t allowed when bit t % 32 of word t // 32 is set): pure numpy, no llguidance."""

from __future__ import annotations

import numpy as np
import pytest

from engine.generation.grammar import GrammarStateError, apply_mask, mask_width, unpack_mask


def _pack(allowed: np.ndarray) -> np.ndarray:
    words = np.zeros(mask_width(allowed.shape[-1]), np.uint32)
    for t in np.flatnonzero(allowed):
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 49152, 151936])
def test_unpack_reads_every_bit_in_place(vocab):
    rng = np.random.default_rng(vocab)
    allowed = rng.random(vocab) < 0.3
    np.testing.assert_array_equal(unpack_mask(_pack(allowed), vocab), allowed)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_apply_mask_rows_and_broadcast(dtype):
    rng = np.random.default_rng(0)
    vocab = 77
    logits = rng.normal(size=(3, vocab)).astype(dtype)
    logits[0, :3] = [np.inf, -np.inf, 0.0]
    allowed = rng.random((3, vocab)) < 0.5
    masks = np.stack([_pack(a) for a in allowed])
    out = apply_mask(logits, masks)
    assert out.dtype == dtype and out is not logits
    np.testing.assert_array_equal(out, np.where(allowed, logits, -np.inf))
    one = apply_mask(logits, masks[1])  # one mask for every row
    np.testing.assert_array_equal(one, np.where(allowed[1], logits, -np.inf))
    np.testing.assert_array_equal(apply_mask(logits[2], masks[2]), out[2])


def test_apply_mask_in_place():
    logits = np.arange(40, dtype=np.float64)
    allowed = np.zeros(40, bool)
    allowed[[0, 33, 39]] = True
    same = apply_mask(logits, _pack(allowed), out=logits)
    assert same is logits and np.flatnonzero(np.isfinite(logits)).tolist() == [0, 33, 39]


def test_a_mask_that_does_not_fit_is_refused():
    with pytest.raises(GrammarStateError, match="mask of 2 words does not fit 100 logits"):
        apply_mask(np.zeros(100, np.float32), np.zeros(2, np.uint32))
    with pytest.raises(GrammarStateError, match="uint32"):
        apply_mask(np.zeros(64, np.float32), np.zeros(2, np.int32))
    with pytest.raises(GrammarStateError, match="does not fit logits of shape"):
        apply_mask(np.zeros((2, 64), np.float32), np.zeros((3, 2), np.uint32))
    with pytest.raises(GrammarStateError, match="floating point"):
        apply_mask(np.zeros(64, np.int64), np.zeros(2, np.uint32))
