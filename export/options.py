"""What every export path shares and none of them needs torch for: options, errors, progress.

Kept apart from the exporter so that the CLI and the console import them without loading
OpenVINO's graph builder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import DeskfleetError
from engine.shards.manifest import StaticInfo

XML_NAME = "openvino_model.xml"
# --weights: the NNCF-equivalent formats, plus "keep" (a GGUF's own blocks, re-packed, never re-rounded)
WEIGHT_FORMATS = ("int4", "int8", "fp16", "fp32", "keep")


class ExportError(DeskfleetError):
    """The export request is invalid (split out of range, output exists, checkpoint unreadable)."""


class CompressionError(DeskfleetError):
    """The requested weight format or group size cannot be applied to this model."""


@dataclass(frozen=True)
class ExportOptions:
    weights: str = "int4"  # one of WEIGHT_FORMATS
    group_size: int = 64
    symmetric: bool = True
    kv_cache_precision: str = "f16"
    beam_idx: bool = True
    context_for_estimate: int = 4096
    force: bool = False
    target: str = "stateful"  # or "npu": static, stateless graphs
    context: int | None = None  # NPU: attention length T of the decode / packed graph
    slots: int = 1  # NPU: > 1 makes the packed graph with this many query rows
    prefill_chunk: int | None = None  # NPU, unpacked: a second graph prefilling C tokens a step

    @property
    def static(self) -> StaticInfo | None:
        if self.target != "npu" or self.context is None:
            return None
        return StaticInfo(context=self.context, slots=self.slots, prefill_chunk=self.prefill_chunk)


Progress = Callable[[int, str], None]  # (stage index, step name)


def check_group_size(group_size: int, dims: dict[str, int]) -> None:
    """INT4 groups run along each weight's input dimension, so they must divide all of them."""
    if group_size <= 0:
        raise CompressionError(f"group size must be positive, got {group_size}")
    bad = {name: d for name, d in dims.items() if d % group_size}
    if bad:
        divisors = sorted({g for g in (32, 64, 128, 256) if all(d % g == 0 for d in dims.values())})
        hint = f"; try --group-size {divisors[-1]}" if divisors else "; use --weights int8"
        raise CompressionError(
            f"INT4 group size {group_size} does not divide "
            + ", ".join(f"{n} ({d})" for n, d in bad.items())
            + hint
        )
