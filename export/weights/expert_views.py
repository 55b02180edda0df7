"""Stacked expert tensors seen as one matrix per expert, for the builder's per-expert weights.

Gemma 4's MoE checkpoints store each layer's experts stacked: ``experts.gate_up_proj``
[E, 2 I, H] (gate rows first) and ``experts.down_proj`` [E, H, I]. The builder quantises experts
one by one from per-expert names (``StageWeights.stacked``), so :class:`ExpertViews` wraps a
:class:`~export.weights.checkpoint.TensorSource` and shows ``experts.{e}.gate_proj``,
``experts.{e}.up_proj`` and ``experts.{e}.down_proj`` [rows, cols] in place of the stacks, read one
expert at a time (the last expert read is kept: its row blocks are asked for in turn).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

GATE_UP = "experts.gate_up_proj"
DOWN = "experts.down_proj"
_STACK = re.compile(r"^(?P<prefix>.*\.)(?P<stack>experts\.gate_up_proj|experts\.down_proj)$")
_VIEW = re.compile(r"^(?P<prefix>.*\.)experts\.(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)$")


def expert_name(prefix: str, expert: int, part: str) -> str:
    """The per-expert view's name: ``{prefix}experts.{e}.{gate_proj|up_proj|down_proj}``."""
    return f"{prefix}experts.{expert}.{part}"


class ExpertViews:
    """A TensorSource whose stacked expert tensors are replaced by per-expert matrices."""

    def __init__(self, source: Any):
        self.source = source
        self.config = source.config
        self._views: dict[str, tuple[str, int, int, int]] = {}  # view -> (stack, expert, first row, rows)
        names = set(source.names())
        for name in list(names):
            m = _STACK.match(name)
            if m is None:
                continue
            dims = tuple(int(d) for d in source.shape(name))
            if len(dims) != 3:
                continue
            names.discard(name)
            experts, rows, _ = dims
            parts = (("gate_proj", 0, rows // 2), ("up_proj", rows // 2, rows // 2)) if m["stack"] == GATE_UP \
                else (("down_proj", 0, rows),)
            for e in range(experts):
                for part, first, count in parts:
                    view = expert_name(m["prefix"], e, part)
                    self._views[view] = (name, e, first, count)
                    names.add(view)
        self._names = frozenset(names)
        self._last: tuple[str, int, np.ndarray] | None = None

    def __getattr__(self, attr: str) -> Any:  # what else the source offers (metadata, stored_name, ...)
        return getattr(self.source, attr)

    def names(self) -> frozenset[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._views:
            return tuple(self.source.shape(name))
        stack, _, _, rows = self._views[name]
        return rows, int(self.source.shape(stack)[2])

    def _expert(self, stack: str, expert: int) -> np.ndarray:
        if self._last is None or self._last[:2] != (stack, expert):
            self._last = (stack, expert, self.source.read_rows(stack, expert, expert + 1)[0])
        return self._last[2]

    def read(self, name: str) -> np.ndarray:
        if name not in self._views:
            return self.source.read(name)
        stack, expert, first, rows = self._views[name]
        return self._expert(stack, expert)[first:first + rows]

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        if name not in self._views:
            return self.source.read_rows(name, start, stop)
        stack, expert, first, _ = self._views[name]
        return self._expert(stack, expert)[first + start:first + stop]
