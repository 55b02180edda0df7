"""``python -m tests.benchmarks placement-scale``: the placement solver at office size.

Issue 16: "the placement MILP at 30 devices × 128 layers returns within 10 s". Compared on the
synthetic office fleets of tests/placement/office_fleet.py (PCs of three kinds, a GPU on every
other PC, LAN latencies), each size with alike interior layers and with layers ±20-30 % apart:

- ``auto``: what `engine.placement.planner.solve` does by default (the counts model, exact on
  alike layers; on different sizes its relaxation/restriction, exact re-splits, then the cuts
  model for the time left), under the default 10 s limit;
- ``cuts``: the layer-range MILP alone (what placement ran before) under the same limit;
- the reference: brute force (every split × every ordered device choice, test_placement's) on
  the small sizes; on the large ones the cuts model under a long limit, when it proves anything.

Rounds are interleaved (each round runs every variant of every size, alternating which goes
first); medians of wall time; objective, optimality and gap per run are in the JSON.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.cli.main import Command
from tests.benchmarks.record import (
    DEFAULT_DOC,
    DEFAULT_JSON_DIR,
    machine_info,
    markdown_table,
    median,
    update_section,
    write_json,
)

COMMAND_LINE = "python -m tests.benchmarks placement-scale"


@dataclass(frozen=True)
class Case:
    devices: int
    layers: int
    spread: float  # 0: alike interior layers
    layer_gb: float
    objective: str = "latency"
    brute: bool = False  # small enough for brute force

    @property
    def name(self) -> str:
        kind = "alike" if self.spread == 0 else f"±{self.spread:.0%}"
        return f"{self.devices}×{self.layers} {kind} {self.objective}"


SMALL = [Case(4, 8, s, 2.5, brute=True) for s in (0.0, 0.3)] + \
        [Case(6, 6, s, 4.0, brute=True) for s in (0.0, 0.3)] + \
        [Case(5, 7, 0.0, 3.0, "throughput", brute=True)]
LARGE = [Case(d, layers, s, 0.45) for d, layers in ((12, 30), (20, 64), (30, 64), (30, 128))
         for s in (0.0, 0.2)] + [Case(30, 128, 0.0, 0.45, "throughput")]
QUICK = [Case(4, 8, 0.0, 2.5, brute=True), Case(4, 8, 0.3, 2.5, brute=True), Case(8, 16, 0.0, 1.6)]


def _fleet(case: Case):
    from tests.placement.office_fleet import office_fleet

    return office_fleet(case.devices, case.layers, spread=case.spread, layer_gb=case.layer_gb)


def _solve(case: Case, formulation: str, time_limit_s: float) -> dict[str, Any]:
    from engine.errors import PlacementTimeout
    from engine.placement.planner import solve
    from engine.placement.types import PlacementRequest

    req = PlacementRequest(objective=case.objective, n_streams=8 if case.objective == "throughput" else 1,
                           time_limit_s=time_limit_s)
    start = time.monotonic()
    try:
        plan = solve(req, **_fleet(case).kwargs(), formulation=formulation)  # type: ignore[arg-type]
    except PlacementTimeout:
        return {"seconds": time.monotonic() - start, "plan": False}
    return {"seconds": time.monotonic() - start, "plan": True, "objective_ms": plan.objective_ms,
            "per_token_ms": plan.per_token_ms, "optimal": plan.optimal, "gap": plan.gap,
            "stages": len(plan.stages)}


def _brute(case: Case) -> dict[str, Any]:
    from engine.placement.types import PlacementRequest
    from tests.placement.test_placement import brute_force

    req = PlacementRequest(objective=case.objective, n_streams=8 if case.objective == "throughput" else 1)
    start = time.monotonic()
    ref = brute_force(req, _fleet(case))[case.objective]
    return {"seconds": time.monotonic() - start, "plan": True,
            "objective_ms": ref["cycle"] if case.objective == "throughput" else ref["latency"], "optimal": True}


def measure(cases: Sequence[Case], rounds: int, time_limit_s: float, long_limit_s: float) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c.name: {"auto": [], "cuts": []} for c in cases}
    refs: dict[str, dict[str, Any]] = {}
    for c in cases:  # the reference once, first
        refs[c.name] = _brute(c) if c.brute else {**_solve(c, "cuts", long_limit_s), "limit_s": long_limit_s}
        print(f"reference {c.name}: {refs[c.name]}", flush=True)
    for r in range(rounds):
        for i, c in enumerate(cases):
            order = ("auto", "cuts") if (r + i) % 2 == 0 else ("cuts", "auto")
            for variant in order:
                runs[c.name][variant].append(_solve(c, variant, time_limit_s))
            print(f"round {r + 1} {c.name}: auto {runs[c.name]['auto'][-1]} cuts {runs[c.name]['cuts'][-1]}",
                  flush=True)
    return {"cases": [c.__dict__ | {"name": c.name} for c in cases], "rounds": rounds,
            "time_limit_s": time_limit_s, "long_limit_s": long_limit_s, "reference": refs, "runs": runs}


def _cell(runs: list[dict[str, Any]], ref: dict[str, Any]) -> tuple[str, str, str]:
    """(median seconds, result vs the reference, proven) for one variant."""
    secs = f"{median([x['seconds'] for x in runs]):.2f}"
    found = [x for x in runs if x["plan"]]
    if not found:
        return secs, "no plan", "-"
    worst = max(x["objective_ms"] for x in found)
    if ref.get("plan"):
        vs = f"{100 * (worst / ref['objective_ms'] - 1):+.2f} %"
    else:
        vs = f"{worst:.2f} ms"
    n_opt = sum(bool(x.get("optimal")) for x in runs)
    gaps = [x["gap"] for x in found if x["gap"]]
    proven = f"optimal {n_opt}/{len(runs)}" + (f", gap ≤ {100 * max(gaps):.2g} %" if gaps else "")
    if len(found) < len(runs):
        proven += f", no plan {len(runs) - len(found)}/{len(runs)}"
    return secs, vs, proven


def render(result: dict[str, Any], command: str) -> str:
    rows = []
    for c in result["cases"]:
        ref = result["reference"][c["name"]]
        if c["brute"]:
            ref_txt = f"brute force {ref['objective_ms']:.2f} ms ({ref['seconds']:.1f} s)"
        elif ref["plan"]:
            ref_txt = (f"cuts {result['long_limit_s']:g} s: {ref['objective_ms']:.2f} ms, "
                       + ("optimal" if ref["optimal"] else f"gap {100 * (ref['gap'] or 0):.2g} %")
                       + f" ({ref['seconds']:.0f} s)")
        else:
            ref_txt = f"cuts {result['long_limit_s']:g} s: no plan"
        auto, cuts = (_cell(result["runs"][c["name"]][v], ref) for v in ("auto", "cuts"))
        rows.append([c["name"], ref_txt, *auto, *cuts])
    m = result["machine"]
    table = markdown_table(["fleet (devices × layers)", "reference", "auto s", "auto vs ref", "auto proven",
                            "cuts s", "cuts vs ref", "cuts proven"], rows)
    return (f"`{command}` → `docs/bench/placement_scale.json` ({m['date']}, {m['cores']} cores, load average "
            f"at start {m['load_average']}, at end {result['load_end']}). Synthetic office fleets "
            "(tests/placement/office_fleet.py: PCs of three kinds, a GPU on every other PC, LAN latencies 0.2-1.0 ms; "
            "layers of 0.45 GB on the large sizes, 2.5-4 GB on the small ones so that they split, plus 1 GB "
            "embedding and head). `auto` is the default solve "
            "(engine/placement/search.py: the counts model, exact when the interior layers are alike; with "
            "layers of different sizes its relaxation and restriction, exact re-splits, then the cuts model for "
            "the time left), `cuts` the layer-range MILP alone (what placement ran before), both under a "
            f"{result['time_limit_s']:g} s limit; {result['rounds']} interleaved rounds, median wall seconds. "
            "'vs ref' is the worst plan's objective (latency, or cycle for throughput with 8 streams) against "
            "the reference's (its optimum, or its best plan when it proved none; in ms when it found none); "
            "'proven' counts the runs proven "
            "optimal and the largest proven gap of the others.\n\n" + table)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every variant (default 3)")
    p.add_argument("--time-limit", type=float, default=10.0, help="the solver's limit in seconds (default 10)")
    p.add_argument("--long-limit", type=float, default=60.0,
                   help="limit of the cuts-model reference on the large sizes (default 60 s)")
    p.add_argument("--quick", action="store_true", help="three small sizes only (a check that it runs)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "placement_scale.json",
                   help="where the raw results go")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown file whose section is rewritten")


def run(args: argparse.Namespace) -> int:
    cases = QUICK if args.quick else SMALL + LARGE
    machine = machine_info()
    result = measure(cases, args.rounds, args.time_limit, args.long_limit)
    result["machine"] = machine
    result["load_end"] = machine_info()["load_average"]
    command = COMMAND_LINE + (" --quick" if args.quick else "") + \
        (f" --rounds {args.rounds}" if args.rounds != 3 else "")
    write_json(args.json, result)
    update_section(args.doc, "placement-scale", render(result, command))
    print(render(result, command))
    return 0


COMMAND = Command(name="placement-scale", help="the placement solver at 30 devices x 128 layers and smaller: "
                  "default solve vs the layer-range MILP vs brute force", configure=configure, run=run)
