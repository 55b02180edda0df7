"""The coordinator's mask/position bookkeeping (pure)."""

import numpy as np
import pytest

from engine.shards.kv_layout import KVLayout


def test_plain_decode_is_all_ones_with_consecutive_positions():
    layout = KVLayout(capacity=2)
    mask, pos = layout.plan(3)
    assert mask.tolist() == [[1, 1, 1]] and pos.tolist() == [[0, 1, 2]]
    layout.append(3)
    mask, pos = layout.plan(1)
    assert mask.tolist() == [[1, 1, 1, 1]] and pos.tolist() == [[3]]
    layout.append(1)
    assert (layout.physical_len, layout.logical_len) == (4, 4)


def test_rewind_masks_positions_and_reuses_logical_positions():
    layout = KVLayout()
    layout.append(5)  # prompt
    layout.append(4)  # 4 drafts verified, the last 3 rejected
    layout.mask_last(3)
    assert (layout.physical_len, layout.logical_len) == (9, 6)
    mask, pos = layout.plan(2)
    assert mask.tolist() == [[1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1]]
    assert pos.tolist() == [[6, 7]]
    assert layout.visible_positions().tolist() == [0, 1, 2, 3, 4, 5]


def test_rewind_skips_already_masked_positions():
    layout = KVLayout()
    layout.append(3)
    layout.mask_last(1)
    layout.append(2)
    layout.mask_last(2)
    assert layout.logical_len == 2
    assert layout.visible_positions().tolist() == [0, 1]


def test_invalid_requests():
    layout = KVLayout()
    with pytest.raises(ValueError):
        layout.plan(0)
    layout.append(2)
    with pytest.raises(ValueError):
        layout.mask_last(3)
    layout.reset()
    assert layout.plan(1)[0].tolist() == [[1]]
    assert isinstance(layout.plan(1)[1], np.ndarray)
