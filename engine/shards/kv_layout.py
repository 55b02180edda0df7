"""Which physical KV-cache positions of one stream are visible, decided by the coordinator alone.

The device cache only ever grows during a generation. Rejected speculative tokens are not
trimmed from it: their positions are switched off in ``attention_mask`` and the next tokens
take position ids that follow the *logical* length, which is bit-exact with a physical trim
at no device cost. Stages hold no policy: they apply the mask and positions they are sent.
"""

from __future__ import annotations

import numpy as np


class KVLayout:
    """Visibility of every physical cache position of one stream (1 = attend, 0 = masked)."""

    def __init__(self, capacity: int = 256):
        self._valid = np.zeros(max(capacity, 1), dtype=np.int64)
        self._physical = 0
        self._logical = 0

    @property
    def physical_len(self) -> int:
        """Positions held in the device cache, masked ones included."""
        return self._physical

    @property
    def logical_len(self) -> int:
        """Positions the model sees: the next token's position id."""
        return self._logical

    def plan(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """attention_mask [1, P + n] and position_ids [1, n] for appending ``n`` tokens."""
        if n <= 0:
            raise ValueError("a step appends at least one token")
        mask = np.ones((1, self._physical + n), dtype=np.int64)
        mask[0, : self._physical] = self._valid[: self._physical]
        positions = np.arange(self._logical, self._logical + n, dtype=np.int64)[None, :]
        return mask, positions

    def append(self, n: int) -> None:
        """Record that ``n`` tokens planned by :meth:`plan` are now in the device cache."""
        need = self._physical + n
        if need > self._valid.shape[0]:
            grown = np.zeros(max(need, 2 * self._valid.shape[0]), dtype=np.int64)
            grown[: self._physical] = self._valid[: self._physical]
            self._valid = grown
        self._valid[self._physical : need] = 1
        self._physical = need
        self._logical += n

    def mask_last(self, k: int) -> None:
        """Hide the last ``k`` appended positions (rejected drafts); they stay in the device cache."""
        if k < 0 or k > self._logical:
            raise ValueError(f"cannot rewind {k} tokens of a {self._logical}-token stream")
        hidden = 0
        i = self._physical - 1
        while hidden < k:
            if self._valid[i]:
                self._valid[i] = 0
                hidden += 1
            i -= 1
        self._logical -= k

    def visible_positions(self) -> np.ndarray:
        """Physical indices still visible, in order (used when a capture compacts the cache)."""
        return np.flatnonzero(self._valid[: self._physical])

    def reset(self) -> None:
        self._physical = 0
        self._logical = 0
        self._valid[:] = 0
