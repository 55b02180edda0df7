"""Link probes for placement: service -> agent measured by the fleet service itself, agent -> agent
measured by agent A on request (``POST /v1/link/measure``), turned into `engine.placement.planner.Links`.

Latencies are one-way (half the median round trip). The fleet service hosts the coordinator, so its
own measurements are the coordinator's latencies. Each unordered pair of agents is measured
once, from the first to the second: `Links.between` uses a pair for both directions.
Bandwidths are kept for display only; the solver does not use them. Every probe is pinned to
the node id the fleet model proved for the agent, and an agent's echo admits another agent only
after the fleet service named it (``POST /v1/link/expect``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import combinations

from console.fleet.fleet import FleetModel
from console.fleet_api.link_report import SERVICE, LinkReport
from engine.control.client import ControlClient, ControlError
from engine.control.links import LinkError, LinkMeasurement, async_measure_link
from engine.placement.types import Links

log = logging.getLogger(__name__)

# A pair of agents that cannot reach each other: a hand-over between them costs this much, so
# the solver only chains them when nothing else fits (and the plan then shows why it is slow).
UNREACHABLE_MS = 1e6


async def async_measure_links(fleet: FleetModel, node_ids: Sequence[str], *, samples: int = 5,
                              nbytes: int = 1 << 20, timeout: float = 30.0) -> LinkReport:
    """Measure the fleet service's link to each agent in ``node_ids`` and every pair between them.

    Probes run one after another so that they do not share (and skew) the links they measure.
    A failure is recorded, never raised: an agent the fleet service cannot reach gets no coordinator
    latency (leave it out of placement, see `LinkReport.unreachable`), a pair of agents that
    cannot reach each other gets `UNREACHABLE_MS`.
    """
    records = [fleet.get(n) for n in node_ids]
    measured: dict[tuple[str, str], LinkMeasurement] = {}
    failures: dict[tuple[str, str], str] = {}
    ssl = fleet.credentials.client_context()
    for r in records:
        try:
            measured[(SERVICE, r.node_id)] = await async_measure_link(
                f"https://{r.address}:{r.control_port}", ssl, samples=samples, nbytes=nbytes, timeout=timeout,
                node_id=r.node_id)
        except LinkError as exc:
            log.warning("link to %s not measured: %s", r.name, exc)
            failures[(SERVICE, r.node_id)] = str(exc)
    reachable = [r for r in records if (SERVICE, r.node_id) in measured]
    for a, b in combinations(reachable, 2):
        client = ControlClient(fleet.credentials, a.address, a.control_port, timeout=timeout, node_id=a.node_id)
        target = ControlClient(fleet.credentials, b.address, b.control_port, timeout=timeout, node_id=b.node_id)
        try:
            await target.async_expect_link(a.node_id)  # b's echo admits a's probes for a minute
            got = await client.async_measure_link(b.control_address, samples=samples, nbytes=nbytes,
                                                  target_node_id=b.node_id)
            measured[(a.node_id, b.node_id)] = LinkMeasurement(float(got["rtt_ms"]), float(got["mbit_s"]))
        except (ControlError, KeyError, TypeError, ValueError) as exc:
            log.warning("link %s -> %s not measured: %s", a.name, b.name, exc)
            failures[(a.node_id, b.node_id)] = str(exc)
    pc_ms = {pair: m.one_way_ms for pair, m in measured.items() if SERVICE not in pair}
    pc_ms.update({pair: UNREACHABLE_MS for pair in failures if SERVICE not in pair})
    coordinator_ms = {dst: m.one_way_ms for (src, dst), m in measured.items() if src == SERVICE}
    return LinkReport(Links(pc_ms=pc_ms, coordinator_ms=coordinator_ms), measured, failures)
