"""Tests that need a feature of the CPU they run on.

The pool has two CPU kinds (AVX2-only, and AVX-512 with avx512_bf16), and the CPU plugin compiles
some settings on one kind only (a bf16 KV cache for PagedAttention: avx512_bf16 only). A test that
needs such a feature says so with :func:`needs_cpu`: the feature is in the test's name
(``..._on_an_avx512_bf16_cpu``), the test is skipped elsewhere with the reason, and it is
registered in :data:`REGISTRY`. tests/architecture/test_cpu_needs.py lists every such test and
fails on a CPU-dependent skip that does not go through here.

Features are read from the CPU plugin (``OPTIMIZATION_CAPABILITIES``), not from /proc/cpuinfo:
what matters is what the plugin compiles for, on Linux and Windows alike.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import pytest

# A feature a test may need -> the OPTIMIZATION_CAPABILITIES entry the CPU plugin reports for it.
FEATURES: Mapping[str, str] = {"avx512_bf16": "BF16"}

F = TypeVar("F", bound=Callable[..., object])


@dataclass(frozen=True)
class CpuNeed:
    """One test that runs only on a CPU with ``feature``, and why."""

    test: str  # "module::function"
    feature: str
    why: str


REGISTRY: list[CpuNeed] = []


class CpuNeedError(ValueError):
    """``needs_cpu`` was used wrongly: an unknown feature, no reason, or a test name without its feature."""


@functools.cache
def cpu_capabilities() -> frozenset[str]:
    """The CPU plugin's OPTIMIZATION_CAPABILITIES on this machine (e.g. FP32, INT8, BF16)."""
    import openvino as ov

    return frozenset(ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def cpu_has(feature: str) -> bool:
    """True when this machine's CPU plugin has ``feature`` (a key of :data:`FEATURES`)."""
    if feature not in FEATURES:
        raise CpuNeedError(f"unknown CPU feature {feature!r}; known: {sorted(FEATURES)}")
    return FEATURES[feature] in cpu_capabilities()


def name_suffix(feature: str) -> str:
    """What a test name needing ``feature`` contains: ``on_an_avx512_bf16_cpu``."""
    article = "an" if feature[:1] in "aeiou" else "a"
    return f"on_{article}_{feature}_cpu"


def needs_cpu(feature: str, why: str, registry: list[CpuNeed] | None = None) -> Callable[[F], F]:
    """Mark a test as needing ``feature``: skipped elsewhere with ``why`` as the reason, registered.

    ``why`` says what the CPU plugin does without the feature, and where the mechanism is tested
    on every CPU. Raises CpuNeedError at import when the test's name does not say the feature."""
    if feature not in FEATURES:
        raise CpuNeedError(f"unknown CPU feature {feature!r}; add it to FEATURES with its capability name")
    if not why.strip():
        raise CpuNeedError(f"a test needing {feature} must say why")
    suffix = name_suffix(feature)

    def mark(test: F) -> F:
        name = getattr(test, "__name__", "")
        if suffix not in name:
            raise CpuNeedError(f"{name} needs {feature}: its name must say so ('..._{suffix}')")
        (REGISTRY if registry is None else registry).append(CpuNeed(f"{test.__module__}::{name}", feature, why))
        return pytest.mark.skipif(not cpu_has(feature), reason=f"needs a CPU with {feature}: {why}")(test)

    return mark
