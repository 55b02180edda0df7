"""Whether this PC keeps a warm spare for its stage: pure, from the setting and free memory.

A spare is a second worker process with the stage's shard opened, converted and compiled
(engine.worker.spare), so it costs about the stage's weights once more in memory and nothing in
CPU while it waits. ``warm_spare`` "on" and "off" decide alone; "auto" keeps one when the PC's
free memory holds the serving worker (its weights and its KV pool), the spare's weights and
:data:`RESERVE_BYTES` left for the person at the PC.
"""

from __future__ import annotations

from dataclasses import dataclass

RESERVE_BYTES = 1 << 30  # what a spare must never take from the person at the PC
COMPILED_FACTOR = 1.25  # a compiled stage takes somewhat more than its files (conversion buffers, kernels)


@dataclass(frozen=True)
class SpareDecision:
    keep: bool
    why: str


def spare_decision(setting: str, *, stage_bytes: int, available_bytes: int | None, kv_pool_bytes: int = 0,
                   worker_running: bool = False) -> SpareDecision:
    """Keep a spare? ``stage_bytes``: the stage's shard files; ``available_bytes``: the PC's
    free memory now (None: unknown); ``worker_running``: the serving worker's memory is already
    taken (not counted again)."""
    if setting == "off":
        return SpareDecision(False, "warm_spare is off")
    if setting == "on":
        return SpareDecision(True, "warm_spare is on")
    if available_bytes is None:
        return SpareDecision(False, "warm_spare is auto and this PC's free memory is unknown")
    weights = int(stage_bytes * COMPILED_FACTOR)
    need = weights + RESERVE_BYTES + (0 if worker_running else weights + kv_pool_bytes)
    mib = 1 << 20
    if available_bytes >= need:
        return SpareDecision(True, f"warm_spare is auto and {available_bytes // mib} MiB are free "
                             f"(a spare needs {weights // mib} MiB, {need // mib} MiB with the worker and the reserve)")
    return SpareDecision(False, f"warm_spare is auto and only {available_bytes // mib} MiB are free; a spare of "
                         f"{weights // mib} MiB would leave less than {RESERVE_BYTES // mib} MiB for this PC's user")
