"""What this agent starts a stage worker with, and whether a warm spare of it may stay beside it.

:func:`stage_worker_launch` turns an assignment into the ``deskfleet worker`` command line and the
secrets it reads from stdin (the fleet certificate and the peer policy: who it takes steps from
and sends them to); the worker keeps reading stdin for peer-policy updates. :func:`spare_decision_now`
asks :mod:`agent.service.spare_policy` with the memory this PC has free at that moment.

:func:`memory_refusal` is the second line behind placement: a stage whose worker would not fit the
memory this PC has free (within its cgroup's limit, `agent.service.pc_facts`) is refused before a
byte is fetched or a model loaded, with the memory it needs and the memory the PC has, rather than
loaded until the kernel's OOM killer ends it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import psutil

from agent.service.pc_facts import own_cgroup_memory
from agent.service.spare_policy import COMPILED_FACTOR, SpareDecision, spare_decision
from agent.service.supervisor import WorkerLaunch, worker_args
from engine.control.messages import Assignment
from engine.suppress import logged_suppress
from engine.trust.fleet_ca import Credentials

log = logging.getLogger(__name__)
MIB = 1 << 20
# A stage worker's own footprint before its weights: Python, OpenVINO's libraries and plugin, the wire and
# TLS stacks (~250-300 MiB resident here). Without it a stage that "fits" thrashes on its own weights' pages
# at its cgroup's limit (found in the office-big benchmark).
WORKER_BASE_BYTES = 320 * MIB

# The stage worker reads peer-policy updates as further JSON lines on stdin (engine.cli.worker).
WORKER_READS_POLICY_UPDATES = True


def stage_worker_launch(creds: Credentials, assignment: Assignment, *, listen: str, shard_dir: Path,
                        cache_dir: Path, kv_pool_mb: int) -> WorkerLaunch:
    """The launch of ``assignment``'s stage worker, listening on ``listen`` (HOST:PORT), its files in
    ``shard_dir``, its compiled models cached in ``cache_dir``; a paged stage's pool gets ``kv_pool_mb``."""
    paged = assignment.runtime == "paged"
    args = worker_args(str(shard_dir), assignment.stage, listen, assignment.next_hop,
                       device=assignment.worker.device, threads=assignment.worker.threads,
                       exact=assignment.worker.exact, tls=True, cache_dir=str(cache_dir), paged=paged,
                       kv_pool_mb=kv_pool_mb if paged else None)
    secrets = json.dumps({"ca_pem": creds.ca_pem.decode(), "cert_pem": creds.cert_pem.decode(),
                          "key_pem": creds.key_pem.decode(), **assignment.peer_policy_json()}).encode() + b"\n"
    return WorkerLaunch(args, secrets, keep_stdin=WORKER_READS_POLICY_UPDATES)


def spare_decision_now(setting: str, assignment: Assignment, *, kv_pool_mb: int,
                       worker_running: bool) -> SpareDecision:
    """Whether a warm spare of ``assignment``'s stage may be kept (the ``warm_spare`` ``setting``),
    with the memory free now (unknown when it cannot be read)."""
    available = None
    with logged_suppress(log, "reading the free memory for the warm-spare decision"):
        available = psutil.virtual_memory().available
    pool = kv_pool_mb << 20 if assignment.runtime == "paged" else 0
    return spare_decision(setting, stage_bytes=sum(e.size for e in assignment.files()),
                          available_bytes=available, kv_pool_bytes=pool, worker_running=worker_running)


def stage_memory_need(assignment: Assignment, *, kv_pool_mb: int) -> tuple[int, int, int]:
    """(need, weights, pool) in bytes: what ``assignment``'s stage worker takes once loaded (its own
    WORKER_BASE_BYTES besides), its compiled weights (the shard's files x COMPILED_FACTOR) and a paged
    stage's KV pool."""
    weights = int(sum(e.size for e in assignment.files()) * COMPILED_FACTOR)
    pool = kv_pool_mb * MIB if assignment.runtime == "paged" else 0
    return WORKER_BASE_BYTES + weights + pool, weights, pool


def memory_refusal(assignment: Assignment, *, kv_pool_mb: int, available_bytes: int | None,
                   total_bytes: int | None = None) -> str | None:
    """Why ``assignment``'s stage cannot be loaded in ``available_bytes`` of free memory (of a
    PC of ``total_bytes``), or None when it fits or the free memory is unknown. Pure."""
    need, weights, pool = stage_memory_need(assignment, kv_pool_mb=kv_pool_mb)
    if available_bytes is None or need <= available_bytes:
        return None
    parts = f"{weights // MIB} MiB of compiled weights, {WORKER_BASE_BYTES // MIB} MiB for the worker itself" + (
        f" and a {pool // MIB} MiB KV pool" if pool else "")
    of = "" if total_bytes is None else f" of its {total_bytes // MIB} MiB"
    return (f"stage {assignment.stage} of {assignment.export_id} needs {need // MIB} MiB of memory ({parts}) but "
            f"this PC has {available_bytes // MIB} MiB free{of}; not loaded. Place the model over more PCs or "
            "on a PC with more memory")


def memory_free_now() -> tuple[int | None, int | None]:
    """(free, total) memory of this PC now, within this process's cgroup limit (None: unreadable)."""
    with logged_suppress(log, "reading the free memory for the stage's memory check"):
        memory = psutil.virtual_memory()
        total, free = own_cgroup_memory().cap(int(memory.total), int(memory.available))
        return free, total
    return None, None
