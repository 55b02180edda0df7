"""The plan frame of the static (NPU-target) path: per row, a slot, an absolute position, a reuse length.

It travels on the wire with every packed step (stage 0 decides it; every later stage follows it),
so it lives with the wire format; what a stage does with it is :mod:`engine.static.packing`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.errors import GenerationError

IDLE = -1  # the slot of a row that serves nobody
_INT64 = np.dtype(np.int64)


@dataclass(frozen=True, eq=False)
class PlanFrame:
    """Stage 0's plan for one inference: per row, a slot, an absolute position, a reuse length.

    ``slot`` [S] (IDLE = -1 for a row that serves nobody), ``position`` [S] the row's token's
    true absolute position, ``reuse`` [S] the prefix its request kept from the slot's previous
    sequence. A row whose position equals its reuse length starts its slot's sequence: that is
    how admission reaches the downstream stages, with no control message of its own. Rows of one
    slot are consecutive positions in row order. int64 arrays, shared: treat them as immutable.
    """

    slot: np.ndarray
    position: np.ndarray
    reuse: np.ndarray

    def __post_init__(self) -> None:
        s = self.slot.shape
        for name in ("slot", "position", "reuse"):
            a = getattr(self, name)
            if not isinstance(a, np.ndarray) or a.dtype != _INT64 or a.ndim != 1 or a.shape != s or not s[0]:
                raise GenerationError(f"PlanFrame.{name} must be int64 [S] like slot {s}")
        idle = self.slot == IDLE
        if (self.slot < IDLE).any() or (self.position < 0).any() or (self.reuse < 0).any():
            raise GenerationError("PlanFrame slots must be >= -1 and positions, reuse >= 0")
        if (self.position[idle] != 0).any() or (self.reuse[idle] != 0).any():
            raise GenerationError("PlanFrame idle rows must carry position 0 and reuse 0")
        if (self.reuse > self.position).any():
            raise GenerationError("PlanFrame reuse length exceeds the row's position")
        for k in np.unique(self.slot[~idle]):
            rows = self.slot == k
            if (np.diff(self.position[rows]) != 1).any() or len(np.unique(self.reuse[rows])) != 1:
                raise GenerationError(f"PlanFrame rows of slot {k} must be consecutive positions "
                                      "in row order with one reuse length")

    @property
    def rows(self) -> int:
        return int(self.slot.shape[0])

    def __repr__(self) -> str:
        return f"PlanFrame(slot={self.slot.tolist()}, position={self.position.tolist()}, reuse={self.reuse.tolist()})"

    @classmethod
    def of(cls, rows: Sequence[tuple[int, int, int]], total: int) -> PlanFrame:
        """A frame from (slot, position, reuse) per live row, padded with idle rows to ``total``."""
        if len(rows) > total:
            raise GenerationError(f"{len(rows)} rows do not fit a {total}-row graph")
        a = np.zeros((3, total), dtype=np.int64)
        a[0, :] = IDLE
        for r, (slot, position, reuse) in enumerate(rows):
            a[:, r] = (slot, position, reuse)
        return cls(a[0], a[1], a[2])
