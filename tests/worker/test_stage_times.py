"""Every stage reports its compute time per step (issue 16): over a real 2-stage stateful ring of
worker processes (loopback sockets) each reply carries one time per stage, the coordinator keeps
each stage's moving median, and the Metrics page's breakdown shows a measured figure for every
stage of the plan (engine.ring.stage_times, console.qt.fleet_metrics)."""

from __future__ import annotations

import numpy as np
import pytest

from console.qt.fleet_metrics import stage_breakdown
from engine.generation.request import GenerationRequest
from engine.placement.types import Plan, PlannedStage
from engine.ring.stage_times import StageTimes, stage_metric
from engine.tools.local_fleet import paged_local_fleet
from tests.conftest import PROMPT_IDS
from tests.support.asyncutil import collect, run


def plan_of(n: int) -> Plan:
    stages = tuple(PlannedStage(f"pc{k}/CPU", f"pc{k}", 2 * k, 2 * k + 1, 1.0, 1 << 20) for k in range(n))
    hops = (0.5,) * (n + 1)
    total = n * 1.0 + sum(hops)
    return Plan(stages=stages, hop_ms=hops, per_token_ms=total, tok_s=1000 / total, bottleneck_ms=1.0, n_streams=1,
                cycle_ms=total, aggregate_tok_s=1000 / total, objective="latency", optimal=True)


def test_stage_times_keep_a_moving_median_per_stage():
    times = StageTimes(window=3)
    for step in ((1.0, 10.0), (2.0, 30.0), (100.0, 20.0), (3.0, 40.0)):  # the first step falls out of the window
        times.add(step)
    times.add((7.0,), first_stage=2)
    assert times.samples() == {0: (2.0, 100.0, 3.0), 1: (30.0, 20.0, 40.0), 2: (7.0,)}
    assert times.medians() == {0: 3.0, 1: 30.0, 2: 7.0}
    assert times.metrics()[stage_metric(1)] == 30.0
    with pytest.raises(ValueError):
        StageTimes(window=0)


def test_every_stage_of_a_real_ring_reports_its_compute_and_the_breakdown_shows_it(tiny_export):
    async def main():
        async with paged_local_fleet(tiny_export("llama", 2), exact=True, kv_pool_bytes=16 << 20) as c:
            tokens = await collect(c, GenerationRequest(PROMPT_IDS, 12, ignore_eos=True))
            await c.async_wait_idle()
            return tokens, c.metrics(), c.path.stage_times.samples()

    tokens, metrics, raw = run(main())
    assert len(tokens) == 12
    assert set(raw) == {0, 1}  # one time per stage on every reply
    assert all(len(v) >= 12 for v in raw.values())  # a prefill step and the decode steps
    medians = [metrics[stage_metric(k)] for k in (0, 1)]
    assert all(np.isfinite(m) and m > 0 for m in medians)
    assert medians == [pytest.approx(float(np.median(raw[k]))) for k in (0, 1)]
    # a step's round trip holds both stages' compute: the medians fit inside the average round trip
    assert sum(medians) < metrics["ring_step_ms_avg"]
    rows = stage_breakdown(plan_of(2), metrics, {}, local_stage0=False)
    computes = [r for r in rows if r.kind == "compute"]
    assert [r.measured_ms for r in computes] == pytest.approx(medians)
    assert rows[-1].what.endswith("network") and rows[-1].measured_ms == pytest.approx(
        max(0.0, metrics["ring_step_ms_avg"] - sum(medians)))
