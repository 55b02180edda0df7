"""Bytes per stored value of each KV cache precision, written once.

Keys are the manifest's ``kv_cache_precision`` (the exporter's ``--kv-cache-precision``) and the
compile overrides; bf16 is held as raw 16-bit words. A u8/i8 cache also carries the CPU plugin's
per-token scale and zero-point rows, which a memory estimate adds itself (engine.paged.kv_pool).
"""

from __future__ import annotations

KV_BYTES_PER_VALUE: dict[str, int] = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i8": 1}
