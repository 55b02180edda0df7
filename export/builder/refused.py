"""Architectures people bring that the builder knows and does not build, each with the reason.

Any architecture outside :data:`export.builder.families.FAMILIES` is refused before any work; one
named here is refused with what it needs that the builder lacks, so the message says why rather
than only what is supported. Keys are both the checkpoint's ``model_type`` and the GGUF's
``general.architecture`` (llama.cpp spells some differently: ``gpt_oss`` vs ``gpt-oss``).
"""

from __future__ import annotations

_GPT_OSS = ("gpt-oss is not supported yet: the builder does not build its attention sinks (a learned per-head "
            "logit in every attention softmax), its sliding-window attention on every other layer, its clamped "
            "SwiGLU experts with biases, or its MXFP4 expert weights")

REFUSED_ARCHITECTURES: dict[str, str] = {
    "gpt_oss": _GPT_OSS,  # HF checkpoint model_type
    "gpt-oss": _GPT_OSS,  # GGUF general.architecture
}


def refusal(architecture: str) -> str | None:
    """Why ``architecture`` (a ``model_type`` or GGUF architecture) is refused, or ``None`` if it is
    not one of the known refusals."""
    return REFUSED_ARCHITECTURES.get(architecture)
