"""Every stage's compute time per step, as the ring's replies report it: a moving median per stage.

Each stage worker times its own inference and appends it to the frame it passes on (the Step's
and Packed's ``stage_ms``), so the last stage's reply carries one time per stage passed,
in ring order (docs/PROTOCOL.md). A coordinator adds each reply's times here; the medians of the
latest ``window`` steps are what its metrics expose as ``stage_compute_ms_per_step{stage="k"}``
(the service's Metrics page shows them next to the placement's prediction). A median, not a mean:
one step that waited on a page fault or a busy core should not move the figure.

Every time also goes into a cumulative histogram per stage (``stage_step_seconds``, bounds in
seconds, the ``_bucket``/``_sum``/``_count`` keys engine.api.api_metrics turns into a Prometheus
histogram): the median answers "how fast now", the histogram "how often slow" over any window.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

DEFAULT_WINDOW = 64  # steps per stage the median is taken over
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)  # seconds


def histogram_metrics(name: str, labels: str, counts: Sequence[int], total: float,
                      bounds: Sequence[float] = STEP_BUCKETS) -> dict[str, float]:
    """A histogram as metric keys: ``counts[i]`` observations in bucket i (not cumulative; the
    last one beyond every bound), ``total`` their sum. ``labels``: ``'stage="1",'`` or ``""``."""
    out, seen = {}, 0
    for bound, n in zip((*map(repr, bounds), "+Inf"), counts, strict=True):
        seen += n
        out[f'{name}_bucket{{{labels}le="{bound}"}}'] = float(seen)
    inner = labels.rstrip(",")
    suffix = f"{{{inner}}}" if inner else ""
    out[f"{name}_sum{suffix}"] = total
    out[f"{name}_count{suffix}"] = float(seen)
    return out


def bucket_of(seconds: float, bounds: Sequence[float] = STEP_BUCKETS) -> int:
    """The index of the bucket ``seconds`` falls in (``len(bounds)``: beyond the last bound)."""
    return next((i for i, b in enumerate(bounds) if seconds <= b), len(bounds))


def stage_metric(stage: int) -> str:
    """The metric name of stage ``stage``'s compute ms per step."""
    return f'stage_compute_ms_per_step{{stage="{stage}"}}'


class StageTimes:
    """The latest ``window`` compute times of every stage (one owner: the coordinator's loop)."""

    def __init__(self, window: int = DEFAULT_WINDOW):
        if window < 1:
            raise ValueError(f"a stage-time window holds at least one step, got {window}")
        self.window = window
        self._times: dict[int, collections.deque[float]] = {}
        self._counts: dict[int, list[int]] = {}  # stage -> observations per bucket (STEP_BUCKETS)
        self._sums: dict[int, float] = {}

    def add(self, stage_ms: Sequence[float], first_stage: int = 0) -> None:
        """One reply's times: ``stage_ms[i]`` is stage ``first_stage + i``'s (a coordinator that
        runs stage 0 itself passes the remote stages' times with ``first_stage=1``)."""
        for i, ms in enumerate(stage_ms):
            stage = first_stage + i
            if stage not in self._times:
                self._times[stage] = collections.deque(maxlen=self.window)
            self._times[stage].append(float(ms))
            counts = self._counts.setdefault(stage, [0] * (len(STEP_BUCKETS) + 1))
            counts[bucket_of(ms / 1000.0)] += 1
            self._sums[stage] = self._sums.get(stage, 0.0) + ms / 1000.0

    def samples(self) -> dict[int, tuple[float, ...]]:
        """stage -> its latest times, oldest first."""
        return {stage: tuple(times) for stage, times in sorted(self._times.items())}

    def medians(self) -> dict[int, float]:
        """stage -> the median of its latest times, for every stage heard from."""
        return {stage: float(np.median(times)) for stage, times in sorted(self._times.items()) if times}

    def metrics(self) -> dict[str, float]:
        out = {stage_metric(stage): ms for stage, ms in self.medians().items()}
        for stage, counts in sorted(self._counts.items()):
            out.update(histogram_metrics("stage_step_seconds", f'stage="{stage}",', counts, self._sums[stage]))
        return out
