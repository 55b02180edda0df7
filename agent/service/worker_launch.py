"""What this agent starts a stage worker with, and whether a warm spare of it may stay beside it.

:func:`stage_worker_launch` turns an assignment into the ``deskfleet worker`` command line and the
secrets it reads from stdin (the fleet certificate and the peer policy: who it takes steps from
and sends them to); the worker keeps reading stdin for peer-policy updates. :func:`spare_decision_now`
asks :mod:`agent.service.spare_policy` with the memory this PC has free at that moment.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import psutil

from agent.service.spare_policy import SpareDecision, spare_decision
from agent.service.supervisor import WorkerLaunch, worker_args
from engine.control.messages import Assignment
from engine.suppress import logged_suppress
from engine.trust.fleet_ca import Credentials

log = logging.getLogger(__name__)

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
