"""The numbers placement works on: a fleet after exclusions, stages, and what a chain of them predicts.

Shared by the two MILP formulations (`engine.placement.milp`'s cuts model, `engine.placement.counts`)
and the planner, which builds the `Fleet` from validated profiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

__all__ = ["GB", "Fleet", "Stage", "Timing", "stage_ms", "time_stages"]

GB = 1e9  # decimal gigabytes in messages; the MILPs work in GB so HiGHS sees O(1) numbers

Stage = tuple[int, int, int]  # (device index, first layer, last layer)


@dataclass(frozen=True)
class Fleet:
    """The candidates after exclusions, as numbers: devices grouped by PC in canonical order."""

    device_ids: tuple[str, ...]  # (D,) names, for the plan only
    pc_ids: tuple[str, ...]  # (P,)
    layer_ms: np.ndarray  # (D,) t[d], one layer for one token
    overhead_ms: np.ndarray  # (D,) o[d], per stage
    dev_pc: np.ndarray  # (D,) index into pc_ids
    dev_cap: np.ndarray  # (D,) usable bytes (headroom applied)
    pc_cap: np.ndarray  # (P,) usable bytes
    lat: np.ndarray  # (P, P) one-way ms
    coord: np.ndarray  # (P,) coordinator <-> PC, each way
    # Per device, because a device may run the model in its own form (an NPU's static shards
    # hold a fixed-context KV window and other graphs than a GPU's stateful ones).
    mem_pre: np.ndarray  # (D, L+1) prefix sums of bytes per layer, embedding/head folded in
    ms_pre: np.ndarray  # (D, L+1) prefix sums of embedding/head ms per layer

    @property
    def n_layers(self) -> int:
        return self.mem_pre.shape[1] - 1

    def stage_bytes(self, d, first, last):
        """Bytes of layers first..last on device d (arrays or scalars)."""
        return self.mem_pre[d, last + 1] - self.mem_pre[d, first]


def stage_ms(f: Fleet, d, first, last):
    """Compute ms of device d on layers first..last; one expression for arrays and scalars so
    the MILP's columns and the reported plan agree to the last bit."""
    t, o = f.layer_ms[d], f.overhead_ms[d]
    return t * (last - first + 1) + o + (f.ms_pre[d, last + 1] - f.ms_pre[d, first])


@dataclass(frozen=True)
class Timing:
    """A chain of stages and what it predicts, recomputed exactly from the profiles (ms)."""

    stages: tuple[Stage, ...]
    compute_ms: tuple[float, ...]  # per stage
    hop_ms: tuple[float, ...]  # coordinator -> stage 0, stage k -> k+1, last -> coordinator
    per_token_ms: float
    bottleneck_ms: float  # slowest stage or hop
    cycle_ms: float  # max(bottleneck_ms, per_token_ms / n_streams)
    optimal: bool  # HiGHS proved optimality of every solve behind it
    gap: float = 0.0  # proven relative gap of the minimised value: (value - lower bound) / value


def time_stages(f: Fleet, stages: Sequence[Stage], n_streams: int, optimal: bool,
                gap: float = 0.0) -> Timing:
    """Predicted times of a chain of stages with ``n_streams`` interleaved streams."""
    compute = tuple(float(stage_ms(f, d, first, last)) for d, first, last in stages)
    pcs = [int(f.dev_pc[d]) for d, _, _ in stages]
    hops = ((float(f.coord[pcs[0]]),) + tuple(float(f.lat[p, q]) for p, q in pairwise(pcs))
            + (float(f.coord[pcs[-1]]),))
    per_token = sum(compute) + sum(hops)
    bottleneck = max(max(compute), max(hops))
    return Timing(stages=tuple(stages), compute_ms=compute, hop_ms=hops, per_token_ms=per_token,
                  bottleneck_ms=bottleneck, cycle_ms=max(bottleneck, per_token / n_streams),
                  optimal=optimal, gap=0.0 if optimal else gap)
