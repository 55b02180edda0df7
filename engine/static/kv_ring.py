"""The host-side KV ring of a static (NPU) stage: pinned attention sinks, true absolute positions.

A static shard cannot keep its cache: every inference takes the past window W as input tensors
``past_key_{i}`` [1, KV, W, D] and returns only the new rows' K/V. The host keeps that window,
split into one contiguous region per slot (one region when unpacked), and writes each new
token's K/V into a column of its slot's region.

A region of R columns fills in order. Once full it slides, but not from column 0: the first
``sinks`` columns stay pinned to the sequence's first tokens, because attention heads park much
of their softmax mass there and a window that evicts them collapses into repetition (StreamingLLM,
paper §8.5). Token n >= R goes to column ``sinks + (n - sinks) mod (R - sinks)``, overwriting the
oldest non-sink token. Every K/V was computed (rotary included) at the token's true absolute
position, which is the slot's token count, so column order never matters: only the mask does.

:class:`SlotRing` is the pure bookkeeping of one region (frozen; every change returns a new
one), so every stage derives the same columns from the same plan. :class:`KVRing` is the storage
of one stage: numpy arrays fed to OpenVINO as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from engine.errors import GenerationError
from engine.shards.tensor_names import new_key, new_value, past_key, past_kv_names, past_value

DEFAULT_SINKS = 4


@dataclass(frozen=True)
class SlotRing:
    """One slot's region of the window: columns ``start .. start + length - 1``.

    ``count`` is how many tokens the slot's sequence has written since it started, which is
    also the absolute position of its next token.
    """

    start: int
    length: int
    sinks: int = DEFAULT_SINKS
    count: int = 0

    def __post_init__(self) -> None:
        if self.length < 1 or self.start < 0 or self.count < 0:
            raise ValueError(f"invalid ring region {self}")
        # At least one column must slide, or a full region could never take a new token.
        object.__setattr__(self, "sinks", max(0, min(self.sinks, self.length - 1)))

    @property
    def wrapped(self) -> bool:
        """True once a token has been evicted (the sequence outgrew the region)."""
        return self.count > self.length

    def column_of(self, n: int) -> int:
        """Window column of the sequence's token ``n`` (0-based absolute position)."""
        if n < self.length:
            return self.start + n
        return self.start + self.sinks + (n - self.sinks) % (self.length - self.sinks)

    def columns(self, n: int) -> np.ndarray:
        """Columns [n] int64 the next ``n`` tokens are written to, in order."""
        return np.array([self.column_of(self.count + k) for k in range(n)], dtype=np.int64)

    def visible(self) -> np.ndarray:
        """Columns [m] int64 holding a live token of the sequence (all R once it has wrapped)."""
        return self.start + np.arange(min(self.count, self.length), dtype=np.int64)

    def reusable(self) -> int:
        """Leading tokens of the sequence still in their own columns (a new sequence sharing that
        prefix may keep them): all of them until the region wraps, then only the sinks."""
        return self.count if self.count <= self.length else self.sinks

    def advanced(self, n: int) -> SlotRing:
        return replace(self, count=self.count + n)

    def restarted(self, keep: int) -> SlotRing:
        """A new sequence in this region that keeps the first ``keep`` tokens of the last one."""
        if not 0 <= keep <= self.reusable():
            raise GenerationError(f"cannot keep {keep} tokens of a slot region whose reusable "
                                  f"prefix is {self.reusable()}; the stages' rings are out of step")
        return replace(self, count=keep)


class KVRing:
    """The past-KV window of one stage: one [1, KV, W, D] float32 array per layer and kind.

    The arrays are the graph's ``past_*`` inputs as they are (no copy per step); after each
    inference the new rows' K/V are written into their columns.
    """

    def __init__(self, layers: Iterable[int], kv_heads: int, head_dim: int, window: int):
        self.layers = list(layers)
        self.window = window
        self.arrays: dict[str, np.ndarray] = {
            name: np.zeros((1, kv_heads, window, head_dim), dtype=np.float32)  # [1, KV, W, D]
            for name in past_kv_names(self.layers)
        }
        # the graph's output that fills each input: new_key_{i} -> past_key_{i}, new_value_{i} -> past_value_{i}
        self._sources = {past: new for i in self.layers
                         for past, new in ((past_key(i), new_key(i)), (past_value(i), new_value(i)))}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def write(self, new: Mapping[str, np.ndarray], rows: np.ndarray, columns: np.ndarray) -> None:
        """Copy rows ``rows`` of every ``new_{kind}_{i}`` [1, KV, S, D] into window ``columns``.

        ``columns`` must not repeat (the layout drops a token overwritten in the same step).
        """
        if rows.size == 0:
            return
        for name, array in self.arrays.items():
            out = new[self._sources[name]]
            array[0][:, columns, :] = out[0][:, rows, :]  # [KV, n, D]

    def fill(self, rng: np.random.Generator, columns: np.ndarray) -> None:
        """Random values in ``columns`` (tests: what another slot's data cannot leak through)."""
        for array in self.arrays.values():
            array[0][:, columns, :] = rng.standard_normal(array[0][:, columns, :].shape, dtype=np.float32)
