"""When a local worker that died is started again: at once after a first crash, after a growing
back-off when it keeps crashing, never while it crash-loops (its held requests then fail, naming
the stage, instead of waiting out the hold time).

Pure: the supervisor (:mod:`engine.tools.local_supervisor`) records each crash's time and asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    """``window_s``: how far back crashes count; ``first_backoff_s``: the wait before the start
    that follows a second crash within the window, doubled for each further one up to
    ``max_backoff_s``; ``max_crashes``: crashes within the window after which the stage is given up
    (until its crashes age out of the window)."""

    window_s: float = 60.0
    first_backoff_s: float = 1.0
    max_backoff_s: float = 8.0
    max_crashes: int = 4

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.first_backoff_s < 0 or self.max_backoff_s < self.first_backoff_s:
            raise ValueError("a restart policy needs window_s > 0 and 0 <= first_backoff_s <= max_backoff_s")
        if self.max_crashes < 1:
            raise ValueError("a restart policy must allow at least one crash (max_crashes >= 1)")

    def recent(self, crashes: Sequence[float], now: float) -> int:
        """How many of ``crashes`` (monotonic times) fall within the window ending ``now``."""
        return sum(1 for t in crashes if now - t <= self.window_s)

    def delay(self, crashes: Sequence[float], now: float) -> float | None:
        """Seconds to wait before starting the worker again, or None: give the stage up."""
        n = self.recent(crashes, now)
        if n > self.max_crashes:
            return None
        if n <= 1:
            return 0.0
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** (n - 2))


SPARE_MARGIN_BYTES = 1 << 30  # left free for everything else on the PC


def spares_fit(weights_bytes: int, pools_bytes: int, available_bytes: int, margin: int = SPARE_MARGIN_BYTES) -> bool:
    """Whether warm spares fit beside the workers: a spare holds another copy of its stage's weights
    (its KV pool is allocated only once it takes over), so what is free before the fleet starts
    must hold the workers (weights and pools), the spares (weights) and ``margin``."""
    return available_bytes >= 2 * weights_bytes + pools_bytes + margin
