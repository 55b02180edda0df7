"""What the link probes found, as placement and the console's Fleet page read it: measured
latencies and bandwidths per pair of node ids, the probes that failed and why, and placement's
`engine.placement.planner.Links`. The fleet service measures (:mod:`console.fleet.links`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from engine.control.links import LinkMeasurement
from engine.placement.types import Links

SERVICE = "console"  # the fleet service's end of a link in `LinkReport` keys (its value is kept in saved placements)
@dataclass(frozen=True)
class LinkReport:
    """What the probes found. ``measured[(src, dst)]`` is keyed by node id (``SERVICE`` for the
    fleet service); ``failures[(src, dst)]`` says why a probe failed; ``links`` is placement's input."""

    links: Links
    measured: Mapping[tuple[str, str], LinkMeasurement]
    failures: Mapping[tuple[str, str], str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "measured", MappingProxyType(dict(self.measured)))
        object.__setattr__(self, "failures", MappingProxyType(dict(self.failures)))

    def mbit_s(self, src: str, dst: str) -> float | None:
        """Measured bandwidth between ``src`` and ``dst`` (either direction), for display."""
        m = self.measured.get((src, dst)) or self.measured.get((dst, src))
        return None if m is None else m.mbit_s

    @property
    def unreachable(self) -> frozenset[str]:
        """Agents the fleet service could not measure: the coordinator cannot reach them."""
        return frozenset(dst for src, dst in self.failures if src == SERVICE)
