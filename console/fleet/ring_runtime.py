"""How the console's ring serves, decided in pure code: paged or static, and a paged ring's pool.

A paged ring (the default for CPU and GPU exports) batches every user's tokens into one infer per
stage per step on OpenVINO's PagedAttention; its stages share one block numbering, so the ring's
pool is as many blocks as its tightest stage may hold. Each agent reports the MiB it gives its
stage's pool (``AgentStatus.kv_pool_mb``: its ``kv_pool_mb`` setting, capped by its RAM); the
console hosting stage 0 gives its own. An NPU-target export serves static (packed slots; its
export fixes them). The stateful runtime was retired: asking for it is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from console.fleet.errors import DistributionError
from engine.control.messages import WorkerSettings
from engine.errors import STATEFUL_RETIRED
from engine.paged.coordinator import block_size_for
from engine.paged.kv_pool import KVPoolError, estimated_block_bytes, pool_blocks_for
from engine.shards.manifest import Manifest, serving_runtime

DEFAULT_STAGE0_KV_POOL_MB = 1024
DEFAULT_SLOTS = 16  # a paged ring's streams at once (a static ring's slots are its export's)
DEFAULT_TOKEN_BUDGET = 256


class PoolBudgetRefusedError(DistributionError):
    """A ring member's KV budget cannot hold a usable pool, or less than the running ring's pool."""


@dataclass(frozen=True)
class RingRuntime:
    """How one ring serves. ``runtime``: ``paged``, which serves a CPU/GPU export paged and an
    NPU-target export static (:func:`serves_paged`); ``stateful`` was retired. ``slots``:
    streams generated at once (None: 16). ``token_budget``: a paged step's new
    tokens over all streams (a long prompt is prefilled in chunks of it). ``stage0_kv_pool_mb``:
    the console's own pool when it hosts stage 0 of a paged ring."""

    runtime: str = "paged"
    slots: int | None = None
    token_budget: int = DEFAULT_TOKEN_BUDGET
    stage0_kv_pool_mb: int = DEFAULT_STAGE0_KV_POOL_MB

    def __post_init__(self) -> None:
        if self.runtime == "stateful":
            raise DistributionError(STATEFUL_RETIRED)
        if self.runtime != "paged":
            raise DistributionError(f"runtime must be 'paged' (a CPU/GPU export serves paged, an NPU-target one "
                                    f"static), got {self.runtime!r}")
        if self.slots is not None and self.slots < 1:
            raise DistributionError(f"slots must be at least 1, got {self.slots}")
        if self.token_budget < 1 or self.stage0_kv_pool_mb < 1:
            raise DistributionError("token_budget and stage0_kv_pool_mb must be positive")

    def slots_for(self, paged: bool) -> int:
        return self.slots or DEFAULT_SLOTS


def serves_paged(runtime: RingRuntime, manifest: Manifest, worker: WorkerSettings) -> bool:
    """Whether the ring serves paged (a CPU/GPU export) rather than static (an NPU-target export);
    a CPU/GPU export on an NPU is refused (PagedAttention runs on CPU and GPU)."""
    paged = serving_runtime(manifest) == "paged"
    if paged and worker.device.startswith("NPU"):
        raise DistributionError(f"a CPU/GPU export cannot serve on {worker.device} (PagedAttention runs on CPU and "
                                "GPU): export the model for the NPU, or serve it on CPU or GPU")
    return paged


def _precision(worker: WorkerSettings) -> str | None:
    return "f32" if worker.exact else None  # the exact settings compile f32 caches


def stage_pool_blocks(manifest: Manifest, worker: WorkerSettings, stage: int, who: str, budget_mb: int) -> int:
    """Blocks ``who``'s budget holds for ``stage``; PoolBudgetRefusedError when not a usable pool."""
    try:
        return pool_blocks_for(manifest, budget_mb << 20, block_size_for(worker.device), range(stage, stage + 1),
                               _precision(worker))
    except KVPoolError as exc:
        raise PoolBudgetRefusedError(f"{who} (stage {stage}) gives its KV pool {budget_mb} MiB, too little: {exc}; "
                                     "raise its kv_pool_mb setting") from exc


def ring_pool_blocks(manifest: Manifest, worker: WorkerSettings, budgets: Sequence[tuple[int, str, int]]) -> int:
    """The paged ring's pool: the fewest blocks any member's budget holds for its stage.
    ``budgets``: (stage, who, MiB) of every member, the console's own stage 0 included."""
    if not budgets:
        raise DistributionError("a paged ring needs at least one stage")
    return min(stage_pool_blocks(manifest, worker, stage, who, mb) for stage, who, mb in budgets)


def pool_refusal(manifest: Manifest, worker: WorkerSettings, stage: int, who: str, budget_mb: int,
                 pool_blocks: int) -> str | None:
    """Why ``who`` cannot serve ``stage`` of a running ring whose pool is ``pool_blocks`` (it joins
    after a failover, and the pool never shrinks), or None when its budget holds the pool."""
    try:
        held = stage_pool_blocks(manifest, worker, stage, who, budget_mb)
    except PoolBudgetRefusedError as exc:
        return str(exc)
    if held >= pool_blocks:
        return None
    model = manifest.model
    per_block = estimated_block_bytes(manifest.stages[stage], model.num_kv_heads, model.head_dim,
                                      block_size_for(worker.device), _precision(worker))
    need_mb = -(-pool_blocks * per_block // (1 << 20))
    return (f"its KV pool budget of {budget_mb} MiB holds {held} blocks of stage {stage}, fewer than the ring's "
            f"{pool_blocks}; set its kv_pool_mb to at least {need_mb} MiB, or re-plan the ring")
