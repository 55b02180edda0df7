"""Rotary inverse frequencies for every static rope type, in numpy (the same arithmetic as HF's).

Every type returns ``inv_freq`` [D / 2] float32 and the attention factor that scales cos/sin.
``longrope`` has two tables: HF switches from the short to the long factors per call when the
sequence (max position + 1) outgrows ``original_max_position_embeddings``; the graph does the
same switch, so :func:`inverse_frequencies` returns both.

``freq_factors`` (a GGUF's ``rope_freqs`` tensor, see :mod:`export.weights.gguf_source`) divide
the type's inverse frequencies, one factor per frequency: ggml's rope computes each angle as
``position * theta_i / factor_i`` before its linear/YaRN scaling, which is the same division.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RotaryTables:
    inv_freq: np.ndarray  # [D / 2] float32 (short factors for longrope)
    scaling: float  # multiplies cos and sin
    long_inv_freq: np.ndarray | None = None  # longrope only
    switch_at: int | None = None  # longrope: the long table applies when max(position) + 1 exceeds this

    def __post_init__(self) -> None:
        if (self.long_inv_freq is None) != (self.switch_at is None):
            raise ValueError("a long table and its switch position come together")


def _base_exponents(dim: int) -> np.ndarray:
    return np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)


def _default(base: float, dim: int) -> np.ndarray:
    return (np.float32(1.0) / (np.float32(base) ** _base_exponents(dim))).astype(np.float32)


def _llama3(p: dict[str, Any], dim: int) -> np.ndarray:
    inv = _default(p["rope_theta"], dim)
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
    smooth = ((np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)).astype(np.float32)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(p: dict[str, Any], dim: int, max_positions: int) -> tuple[np.ndarray, float]:
    base = float(p["rope_theta"])
    original = float(p["original_max_position_embeddings"])
    factor = p.get("factor") or max_positions / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_weight = (1 - ramp).astype(np.float32)
    pos_freqs = np.float32(base) ** _base_exponents(dim)
    extrapolated = np.float32(1.0) / pos_freqs
    interpolated = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv.astype(np.float32), float(attention)


def inverse_frequencies(rope: dict[str, Any], head_dim: int, max_positions: int) -> RotaryTables:
    """The rotary tables of ``rope`` (the config's rope parameters) for heads of ``head_dim``."""
    tables = _tables(rope, head_dim, max_positions)
    factors = rope.get("freq_factors")
    if factors is None:
        return tables
    divisors = np.asarray(factors, dtype=np.float32)
    if divisors.shape != tables.inv_freq.shape or tables.long_inv_freq is not None:
        raise ValueError(f"{divisors.size} frequency factors do not fit {rope.get('rope_type')!r} rope of "
                         f"{tables.inv_freq.size} frequencies")
    return RotaryTables((tables.inv_freq / divisors).astype(np.float32), tables.scaling)


def _tables(rope: dict[str, Any], head_dim: int, max_positions: int) -> RotaryTables:
    kind = rope.get("rope_type", "default")
    base = float(rope.get("rope_theta", 10000.0))
    dim = head_dim
    if kind == "default":
        return RotaryTables(_default(base, dim), 1.0)
    if kind == "proportional":  # Gemma 4's full layers: the first frequencies turn, the rest stay still
        turning = int(float(rope.get("partial_rotary_factor", 1.0)) * dim // 2)
        inv = np.zeros(dim // 2, dtype=np.float32)
        inv[:turning] = _default(base, dim)[:turning]
        return RotaryTables((inv / np.float32(rope.get("factor", 1.0))).astype(np.float32), 1.0)
    if kind == "linear":
        return RotaryTables((_default(base, dim) / np.float32(rope["factor"])).astype(np.float32), 1.0)
    if kind == "llama3":
        return RotaryTables(_llama3(rope, dim), 1.0)
    if kind == "yarn":
        inv, attention = _yarn(rope, dim, max_positions)
        return RotaryTables(inv, attention)
    if kind == "longrope":
        original = int(rope["original_max_position_embeddings"])
        factor = rope.get("factor") or max_positions / original
        given = rope.get("attention_factor")
        attention = (float(given) if given is not None
                     else 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
        shape = np.float32(base) ** _base_exponents(dim)

        def table(factors: list[float]) -> np.ndarray:
            return (np.float32(1.0) / (np.asarray(factors, dtype=np.float32) * shape)).astype(np.float32)

        return RotaryTables(table(rope["short_factor"]), float(attention), table(rope["long_factor"]), original)
    raise ValueError(f"rope type {kind!r} has no static frequencies")
