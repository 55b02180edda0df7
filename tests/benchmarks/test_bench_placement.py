"""The placement benchmark's core on the tiny model and two real agents on loopback: it places,
exports the plan's split, distributes it, measures one stream through the ring, and records
predictions and measurements in the structure the report is written from. (Whether the
prediction is within 20 % is the benchmark's finding, not asserted here.)"""

from __future__ import annotations

import pytest

from engine.placement.types import Plan, PlannedStage
from tests.benchmarks.placement import PlacementBench, async_run_bench, error_pct, predict
from tests.benchmarks.placement_report import fit_stage_cpu, render
from tests.conftest import PROMPT_IDS
from tests.support.asyncutil import run

pytestmark = pytest.mark.usefixtures("private_keyring")


@pytest.fixture(scope="module")
def library(tmp_path_factory, tiny_checkpoint):
    """The tiny model's calibration exports, built before the test (the exporter leaves a
    transformers worker thread behind in this process)."""
    from console.fleet.calibration_export import build_calibration_set
    from export.exporter import ExportOptions

    root = tmp_path_factory.mktemp("library")
    build_calibration_set(tiny_checkpoint("llama"), root, ExportOptions(weights="fp32"))
    return root


def test_the_core_places_distributes_and_measures_two_agents(tmp_path, tiny_checkpoint, library):
    # The tiny model's stages cost mostly fixed overhead, so whether a split pays off is down to
    # calibration noise; the group's plan has one stage per agent all the same (min_stages).
    bench = PlacementBench(model=tiny_checkpoint("llama"), library=library, weights="fp32", agent_counts=(2,),
                           tokens=8, runs=2, warmups=1, calibration_steps=4, plan_streams=4,
                           prompt_ids=PROMPT_IDS)
    result = run(async_run_bench(tmp_path / "work", bench))

    (group,) = result["groups"]
    plan = group["plan"]
    assert group["agents"] == 2 and plan["objective"] == "throughput" and plan["n_streams"] == 4
    stages = plan["stages"]
    assert len(stages) == 2 and {s["pc_id"] for s in stages} == set(group["names"])
    assert stages[0]["first_layer"] == 0 and stages[-1]["last_layer"] == 3
    assert all(b["first_layer"] == a["last_layer"] + 1 for a, b in zip(stages, stages[1:], strict=False))
    assert len(plan["hop_ms"]) == 3
    assert group["split"] == [s["first_layer"] for s in stages[1:]]
    assert plan["tok_s"] > 0 and group["measured_tok_s"] > 0 and group["one_thread"]["tok_s"] > 0
    assert len(group["runs_detail"]) == 2 and all(r["tokens"] == 8 for r in group["runs_detail"])
    assert len(group["measured_stage_cpu_ms"]) == len(stages) and all(ms > 0 for ms in group["measured_stage_cpu_ms"])
    assert group["error_pct"] == pytest.approx(error_pct(plan["tok_s"], group["measured_tok_s"]))
    assert len(group["latency_plan"]["stages"]) >= 1
    assert result["stage_cpu_fit"] is None  # two stages cannot separate layer, stage and head costs

    result.update(command="python -m tests.benchmarks placement", load_average_end=[0.0, 0.0, 0.0],
                  machine={"date": "today", "cores": 2, "openvino": "x", "load_average": [0.0, 0.0, 0.0]})
    text = render(result, tmp_path / "placement.json")
    assert "predicted tok/s" in text and "Reading these numbers" in text


def test_predict_reproduces_the_solvers_stage_times():
    stages = (PlannedStage("a/CPU", "a", 0, 9, 10 * 0.5 + 1.0, 1),
              PlannedStage("b/CPU", "b", 10, 29, 20 * 0.6 + 2.0 + 3 * 0.6, 1))
    plan = Plan(stages=stages, hop_ms=(0.1, 0.2, 0.3), per_token_ms=0.0, tok_s=1.0, bottleneck_ms=0.0, n_streams=1,
                cycle_ms=0.0, aggregate_tok_s=0.0, objective="latency", optimal=True)
    per_stage, per_token = predict(plan, [(0.5, 1.0), (0.6, 2.0)], head_ratio=3.0)
    assert per_stage == pytest.approx([s.compute_ms for s in stages])
    assert per_token == pytest.approx(sum(per_stage) + 0.6)


def test_the_cpu_fit_recovers_layer_stage_and_head_costs():
    def group(*cuts: tuple[int, int]) -> dict:
        stages = [{"first_layer": a, "last_layer": b} for a, b in cuts]
        cpu = [(b - a + 1) * 0.8 + 4.0 + (6.0 if k == len(cuts) - 1 else 0.0) for k, (a, b) in enumerate(cuts)]
        return {"plan": {"stages": stages}, "measured_stage_cpu_ms": cpu}

    fit = fit_stage_cpu([group((0, 29)), group((0, 16), (17, 29)), group((0, 10), (11, 21), (22, 29))])
    assert fit["layer_ms"] == pytest.approx(0.8) and fit["stage_ms"] == pytest.approx(4.0)
    assert fit["head_ms"] == pytest.approx(6.0) and fit["worst_residual_ms"] < 1e-9
    assert fit_stage_cpu([group((0, 16), (17, 29))]) is None
