"""How many PagedAttention blocks a KV memory budget holds: the one memory that grows with users.

A paged ring's stages share one block numbering (the coordinator's block tables are valid on
every stage), so the ring's pool is as many blocks as its tightest stage can hold. This module
estimates a stage's bytes per block from the manifest alone, before anything is compiled, so the
coordinator of a remote ring can size the pool; a stage checks the real size of its compiled
cache tensors against its own budget when it allocates (engine.paged.stage).
"""

from __future__ import annotations

from engine.errors import DeskfleetError
from engine.shards.kv_precision import KV_BYTES_PER_VALUE
from engine.shards.manifest import Manifest, StageManifest
from engine.wire.step_plan import MAX_POOL_BLOCKS, SCRATCH_BLOCKS

DEFAULT_KV_POOL_BYTES = 1 << 30  # 1 GiB per stage when nobody says otherwise


class KVPoolError(DeskfleetError):
    """The KV budget cannot hold a usable pool (or a setting is out of range)."""


def estimated_block_bytes(stage: StageManifest, num_kv_heads: int, head_dim: int, block_size: int,
                          precision: str | None = None) -> int:
    """K + V bytes of one block over the stage's layers at its KV precision, or ``precision``
    when the compile overrides it (the exact settings use f32); u8 carries the CPU plugin's scale
    and zero-point rows (NOTES-paged-attention.md, "KV cache geometry")."""
    layers = stage.last_layer - stage.first_layer + 1
    precision = (precision or stage.kv_cache_precision).lower()
    if precision in ("u8", "i8"):
        per_layer = num_kv_heads * ((block_size + 8) * head_dim + block_size * (head_dim + 8))
    else:
        per_layer = 2 * num_kv_heads * block_size * head_dim * KV_BYTES_PER_VALUE.get(precision, 2)
    return layers * per_layer


def pool_blocks_for(manifest: Manifest, budget_bytes: int, block_size: int,
                    stages: range | None = None, precision: str | None = None) -> int:
    """Blocks of the ring's pool: what the tightest stage's ``budget_bytes`` holds (capped by the
    protocol); KVPoolError when that is not even one block beyond the scratch blocks."""
    if budget_bytes <= 0:
        raise KVPoolError(f"the KV pool budget must be positive, got {budget_bytes} bytes")
    model = manifest.model
    chosen = manifest.stages if stages is None else [manifest.stages[i] for i in stages]
    per_block = max(estimated_block_bytes(s, model.num_kv_heads, model.head_dim, block_size, precision)
                    for s in chosen)
    blocks = min(MAX_POOL_BLOCKS, budget_bytes // per_block)
    if blocks <= SCRATCH_BLOCKS:
        raise KVPoolError(f"a KV budget of {budget_bytes / 2**20:.1f} MiB holds {blocks} blocks of "
                          f"{per_block / 2**10:.0f} KiB; at least {SCRATCH_BLOCKS + 1} are needed "
                          f"({(SCRATCH_BLOCKS + 1) * per_block / 2**20:.1f} MiB)")
    return blocks
