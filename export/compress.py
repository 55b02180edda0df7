"""Weight compression presets (NNCF) applied to one stage's OpenVINO model: the traced NPU path only
(the CPU/GPU builder lowers weights in numpy, :mod:`export.weights`).

Every weight is compressed by a rule that depends only on what the weight is, never on which
stage it sits in: NNCF alone treats the last MatMul of *any* graph as the model's head and keeps
it at INT8, which would make a split INT4 model differ from the unsplit one. So INT4 runs in two
passes: embedding and LM head to INT8 first (as the usual monolithic recipe keeps them), then
every remaining MatMul to INT4 with ``all_layers`` so no decoder matmul is singled out.
"""

from __future__ import annotations

from dataclasses import dataclass

import openvino as ov

from export.options import CompressionError, check_group_size

__all__ = ["PRESETS", "CompressionError", "WeightPreset", "check_group_size", "compress"]


@dataclass(frozen=True)
class WeightPreset:
    name: str
    description: str
    fp16_ir: bool  # store remaining float constants as fp16 in the IR


PRESETS: dict[str, WeightPreset] = {
    "int4": WeightPreset("int4", "INT4 group-wise decoder weights, INT8 embedding and head", fp16_ir=True),
    "int8": WeightPreset("int8", "INT8 (asymmetric, per channel) weights everywhere", fp16_ir=True),
    "fp16": WeightPreset("fp16", "fp16 weights, fp32 compute as the device decides", fp16_ir=True),
    "fp32": WeightPreset("fp32", "uncompressed fp32 weights", fp16_ir=False),
}

# Node-name patterns of decoder-layer weights in a converted stage (module path ``layers.N``).
_DECODER_PATTERN = r".*layers\.\d+\..*"


def compress(model: ov.Model, weights: str, group_size: int, symmetric: bool = True) -> ov.Model:
    """Compress ``model`` in place according to ``weights`` (int4, int8, fp16, fp32)."""
    if weights not in PRESETS:
        raise CompressionError(f"unknown weight format {weights!r}; choose one of {', '.join(PRESETS)}")
    if weights in ("fp16", "fp32"):
        return model
    import nncf  # heavy import: only when compressing

    mode = nncf.CompressWeightsMode
    if weights == "int8":
        return nncf.compress_weights(model, mode=mode.INT8_ASYM)
    # Pass 1: embedding + head (everything outside the decoder layers) to INT8.
    model = nncf.compress_weights(
        model,
        mode=mode.INT8_ASYM,
        ignored_scope=nncf.IgnoredScope(patterns=[_DECODER_PATTERN], validate=False),
    )
    # Pass 2: every still-float MatMul to INT4; already-compressed weights are left alone.
    return nncf.compress_weights(
        model,
        mode=mode.INT4_SYM if symmetric else mode.INT4_ASYM,
        group_size=group_size,
        ratio=1.0,
        all_layers=True,
    )
