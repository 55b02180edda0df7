"""Mixture-of-experts as placement sees it: memory holds every expert, a step reads the routed ones.

A MoE layer stacks its E experts' weights; each token is routed to k of them, and the runtime
(the CPU's GatherMatmul) reads only the slices of the experts some row of the step was routed
to. A step of B rows therefore streams the dense weights once and, of the expert weights, the
fraction (distinct experts touched) / E. With k distinct picks per row, each expert missed by
one row with probability 1 - k/E, and rows routed independently and uniformly (the assumption;
a trained router is skewed, which touches fewer experts, so this errs towards slower):

    expected distinct experts  D(B) = E · (1 − (1 − k/E)^B)        D(1) = k, D(∞) = E, D = E when k = E

Pure arithmetic (no OpenVINO); the export's manifest records E, k and the bytes
(`engine.shards.manifest.StageMoe`), read here into `MoeWeights`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import PlacementInputError
from engine.shards.manifest import Manifest

__all__ = ["ExpertRouting", "MoeWeights", "expected_experts", "moe_weights", "streamed_bytes"]


@dataclass(frozen=True)
class ExpertRouting:
    """E experts per MoE layer, k of them per token (the model's top-k)."""

    experts: int
    per_token: int

    def __post_init__(self) -> None:
        if not 0 < self.per_token <= self.experts:
            raise PlacementInputError(f"a mixture of experts needs 0 < experts per token ({self.per_token}) "
                                      f"<= experts ({self.experts})")

    def read_fraction(self, rows: int) -> float:
        """The expected share of the expert weights a step of ``rows`` rows reads: D(B) / E."""
        return expected_experts(self, rows) / self.experts


def expected_experts(routing: ExpertRouting, rows: int) -> float:
    """D(B) = E · (1 − (1 − k/E)^B): the distinct experts B rows touch on average (module doc)."""
    if rows < 0:
        raise PlacementInputError(f"a step has no fewer than 0 rows, not {rows}")
    e, k = routing.experts, routing.per_token
    return e * (1.0 - (1.0 - k / e) ** rows)


def streamed_bytes(dense_bytes: float, expert_bytes: float, routing: ExpertRouting | None, rows: int) -> float:
    """Weight bytes one step of ``rows`` rows reads: the dense ones whole, the experts' by the
    share routed to (all of them without ``routing``: a dense model, or one priced as dense)."""
    if routing is None or expert_bytes == 0:
        return dense_bytes + expert_bytes
    return dense_bytes + expert_bytes * routing.read_fraction(rows)


@dataclass(frozen=True)
class MoeWeights:
    """A MoE model's (or stage's) weights: ``expert_bytes`` read by routing, ``dense_bytes``
    (everything else, embedding and head included) read whole. Memory counts both."""

    routing: ExpertRouting
    expert_bytes: int
    dense_bytes: int

    def __post_init__(self) -> None:
        if self.expert_bytes < 0 or self.dense_bytes < 0:
            raise PlacementInputError(f"expert and dense bytes cannot be negative ({self.expert_bytes}, "
                                      f"{self.dense_bytes})")

    def describe(self) -> str:
        """One line for a person: what memory holds and what a step reads."""
        e, k = self.routing.experts, self.routing.per_token
        return (f"MoE: {e} experts, {k} active per token — memory counts all experts "
                f"({self.expert_bytes / 1e6:,.1f} MB), each step reads the active ones "
                f"(~{self.expert_bytes * k / e / 1e6:,.1f} MB for one token)")


def moe_weights(manifest: Manifest) -> MoeWeights | None:
    """The whole export's MoE weights, summed over its stages; None for a dense model or a
    manifest written before MoE was recorded (read as dense)."""
    first = manifest.moe
    if first is None:
        return None
    entries = [s.moe for s in manifest.stages if s.moe is not None]
    return MoeWeights(ExpertRouting(first.experts, first.per_token), expert_bytes=sum(m.expert_bytes for m in entries),
                      dense_bytes=sum(m.dense_bytes for m in entries))
