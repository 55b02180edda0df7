"""Packed multi-slot serving on static graphs: slot regions, the plan frame, and the masks.

Pure code (numpy only): no OpenVINO, no sockets. The packed graph has S query rows and a past
window of W = T - S columns split into S equal regions, one per slot (paper §8.6). Each step,
stage 0 decides which row serves which slot at which absolute position - a :class:`PlanFrame` -
and every stage, stage 0 included, turns that frame into the same :class:`StepLayout` with
:func:`layout_step`: which window and query columns each row may attend to, and which window
column each new K/V goes to. Stages never exchange their rings; they stay in lockstep because
they apply the same frames to the same starting state.

The mask of one step, rows x (W window columns | S query columns)::

    decode row of slot k     its slot's live columns              | its own query column
    prefill rows of slot k   its slot's live columns              | same-slot rows at or before it (causal)
    idle row r               nothing                              | its own column W + r

An idle row opens its own column instead of none: a fully masked row is NaN out of softmax
(or uniform, depending on the kernel) and would poison the rows sharing the inference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.errors import GenerationError
from engine.static.kv_ring import DEFAULT_SINKS, SlotRing
from engine.wire.plan_frame import IDLE, PlanFrame


class LockstepError(GenerationError):
    """A plan frame does not follow from a stage's ring state: the stages are out of step."""


@dataclass(frozen=True)
class SlotGeometry:
    """How the window of one static export is shared: ``slots`` regions of ``region`` columns.

    ``window`` is W = context - rows of the main graph. Columns past ``slots * region`` (when W
    does not divide evenly) are never used.
    """

    window: int
    slots: int = 1
    sinks: int = DEFAULT_SINKS

    def __post_init__(self) -> None:
        if self.slots < 1 or self.window // self.slots < 1:
            raise GenerationError(f"a {self.window}-column window cannot hold {self.slots} slot(s)")

    @property
    def region(self) -> int:
        return self.window // self.slots

    def rings(self) -> tuple[SlotRing, ...]:
        """Every slot's empty region."""
        return tuple(SlotRing(start=k * self.region, length=self.region, sinks=self.sinks)
                     for k in range(self.slots))


@dataclass(frozen=True, eq=False)
class StepLayout:
    """What one stage does with one plan frame.

    ``mask`` bool [S, W + S]: row r may attend to column c. ``write_rows``/``write_columns``
    int64 [n]: new K/V row -> window column. ``rings``: every slot after the step.
    """

    mask: np.ndarray
    write_rows: np.ndarray
    write_columns: np.ndarray
    rings: tuple[SlotRing, ...]


def layout_step(rings: Sequence[SlotRing], frame: PlanFrame, window: int) -> StepLayout:
    """The mask and KV writes for ``frame`` on a stage whose slots are ``rings`` (pure).

    Raises :class:`LockstepError` when a slot's first row neither continues the slot (position =
    its count) nor starts it (position = reuse, with that much still reusable).
    """
    s = frame.rows
    mask = np.zeros((s, window + s), dtype=bool)
    out = list(rings)
    write_rows: list[np.ndarray] = []
    write_cols: list[np.ndarray] = []
    for r in np.flatnonzero(frame.slot == IDLE):
        mask[r, window + r] = True
    for k in np.unique(frame.slot[frame.slot != IDLE]):
        k = int(k)
        if k >= len(rings):
            raise LockstepError(f"plan frame names slot {k}; this stage has {len(rings)} slot(s)")
        rows = np.flatnonzero(frame.slot == k)
        first, reuse = int(frame.position[rows[0]]), int(frame.reuse[rows[0]])
        ring = rings[k]
        if first == reuse:
            if reuse > ring.reusable():
                raise LockstepError(f"plan frame restarts slot {k} keeping {reuse} tokens, but only "
                                    f"{ring.reusable()} are reusable on this stage")
            ring = ring.restarted(reuse)
        elif first != ring.count:
            raise LockstepError(f"plan frame continues slot {k} at position {first}, but this stage's "
                                f"ring is at {ring.count}; the stages are out of step")
        visible = ring.visible()
        mask[np.ix_(rows, visible)] = True
        mask[np.ix_(rows, window + rows)] = np.tril(np.ones((len(rows), len(rows)), dtype=bool))
        cols = ring.columns(len(rows))
        # A chunk longer than the sliding part overwrites its own earlier tokens: keep the last.
        _, last = np.unique(cols[::-1], return_index=True)
        keep = np.sort(len(cols) - 1 - last)
        write_rows.append(rows[keep])
        write_cols.append(cols[keep])
        out[k] = ring.advanced(len(rows))
    empty = np.zeros(0, dtype=np.int64)
    return StepLayout(mask=mask,
                      write_rows=np.concatenate(write_rows) if write_rows else empty,
                      write_columns=np.concatenate(write_cols) if write_cols else empty,
                      rings=tuple(out))


def additive_bias(mask: np.ndarray) -> np.ndarray:
    """The packed graph's ``attention_bias`` float32 [1, 1, S, T]: 0 to attend, float32 min not to
    (the value the exported model itself uses, so an unmasked row computes the same numbers)."""
    return np.where(mask, np.float32(0.0), np.finfo(np.float32).min).astype(np.float32)[None, None]


def shared_mask(layout: StepLayout, frame: PlanFrame, window: int) -> np.ndarray:
    """The unpacked graphs' ``attention_mask`` int64 [1, W + S], one row shared by every row.

    Only valid for a single slot whose rows come first (idle rows trail as padding): the graph
    applies causality among the S new columns itself, so padding rows never reach a live row.
    """
    live = frame.slot != IDLE
    if len(np.unique(frame.slot[live])) > 1 or (live[1:] & ~live[:-1]).any():
        raise GenerationError("an unpacked graph serves one slot whose rows come first; "
                              "use the packed export for several slots")
    out = np.ones((1, window + frame.rows), dtype=np.int64)
    out[0, :window] = layout.mask[:, :window].any(axis=0)
    return out
