"""The office benchmark: what N emulated PCs serve against one, on the emulated office
(tests/support/office: each PC its own network namespace, cores, memory limit and agent).

Layouts, each placed by the real fleet service on real agents, measured with distinct prompts from
the people's PC through the real openai client (greedy, ``--tokens`` each, all users at once):

* ``one``: one PC serving the 1-stage export;
* ``copies``: every desk serving its own 1-stage ring, the rings behind the service's router;
* ``ring``: one ring of the ``--desks``-stage export, a stage per desk.

Rounds rotate the order of the layouts (every layout once per round); each figure is the median
over rounds, with each desk's CPU use as a fraction of its share (its cgroup's CPU time) to show
where a round goes.

The layout check: the fleet service places the default model over the desks (measured and
calibrated, ``POST /placements``) and `engine.placement.layouts` proposes, for each user count,
the layout it predicts serves the most; the check passes where the proposal is the measured best
or within :data:`LAYOUT_TOLERANCE` (the prediction error allowed) of it (``--no-layout-check``: skip).

``--quick`` runs the smallest version once (two ½-core desks, 1 and 2 users, 16 tokens, one round)
and records nothing in docs/BENCHMARKS.md: a check that the kit runs.

Needs root, network namespaces and the v1 cgroup controllers (it says which is missing).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.cli.main import Command
from tests.benchmarks.record import DEFAULT_DOC, DEFAULT_JSON_DIR, machine_info, markdown_table, median, update_section
from tests.benchmarks.rings import rotated

LAYOUTS = ("one", "copies", "ring")
LAYOUT_TOLERANCE = 0.15  # the prediction error allowed (issue 30's target for every row)
QUICK = {"desks": 2, "cores": 0.5, "users": "1,2", "tokens": 16, "rounds": 1}
NOT_MEASURED = "not yet measured on a quiet machine"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="the smallest run, once (2 desks of ½ core, 1 and 2 users, 16 tokens); records nothing")
    p.add_argument("--desks", type=int, default=2, help="desk PCs (default 2)")
    p.add_argument("--cores", type=float, default=1.0, help="cores per desk: 1, 0.5, 2 ... (default 1)")
    p.add_argument("--memory-mb", type=int, default=3072, help="memory limit per desk (default 3072 MiB)")
    p.add_argument("--users", default="1,2,8,16", help="concurrent users, comma-separated (default 1,2,8,16)")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per answer (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, every layout once per round (default 3)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"which of {', '.join(LAYOUTS)} (default all)")
    p.add_argument("--weights", default="int4", help="the default model's export weights (default int4)")
    p.add_argument("--exports", default=None, metavar="ONE,RING",
                   help="a 1-stage and a --desks-stage export to serve instead of the default model's")
    p.add_argument("--no-layout-check", action="store_true",
                   help="skip placing the default model and checking the proposed layout against the measured best")
    p.add_argument("--json", type=Path, default=None, help=f"raw results (default {DEFAULT_JSON_DIR}/office.json; "
                                                            "--quick: none unless given)")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown whose office section is rewritten")


def apply_quick(args: argparse.Namespace) -> argparse.Namespace:
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    return args


def command_line(args: argparse.Namespace) -> str:
    if args.quick:
        return "python -m tests.benchmarks office --quick"
    return (f"python -m tests.benchmarks office --desks {args.desks} --cores {args.cores:g} --memory-mb "
            f"{args.memory_mb} --users {args.users} --tokens {args.tokens} --rounds {args.rounds} --layouts "
            f"{args.layouts} --weights {args.weights}" + (" --no-layout-check" if args.no_layout_check else ""))


def _exports(args: argparse.Namespace) -> tuple[Path, Path]:
    if args.exports:
        one, ring = (Path(x) for x in args.exports.split(","))
        return one, ring
    from tests.benchmarks.kit import default_model_exports

    _, (one, ring), _ = default_model_exports((args.weights, 1, True), (args.weights, args.desks, True))
    return one, ring


def say(text: str) -> None:
    print(f"[office] {text}", file=sys.stderr, flush=True)


async def _place(office, layout: str, one: Path, ring: Path) -> None:
    desks = office.desks
    if layout == "one":
        await office.async_place(one, desks[:1], standby=[])
    elif layout == "copies":
        for desk in desks:
            await office.async_place(one, [desk], standby=[])
    else:
        await office.async_place(ring, desks, standby=[])


async def _measure(office, args: argparse.Namespace, one: Path, ring: Path) -> list[dict[str, Any]]:
    from tests.support.office.users import ask

    layouts = [x for x in args.layouts.split(",") if x]
    url, key, ca = await office.async_api()
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for layout in rotated(layouts, r):
            await office.async_stop_rings()
            started = time.perf_counter()
            await _place(office, layout, one, ring)
            say(f"round {r + 1}: {layout} placed in {time.perf_counter() - started:.0f} s")
            await asyncio.to_thread(ask, office.people, url, key, users=1, max_tokens=4, ca_file=ca)  # warm-up
            for users in _ints(args.users):
                cpu0 = {d.name: d.group.cpu_seconds() for d in office.desks}
                answers = await asyncio.to_thread(ask, office.people, url, key, users=users, max_tokens=args.tokens,
                                                  first_user=1000 * r + 100 * users, ca_file=ca)
                busy = {d.name: (d.group.cpu_seconds() - cpu0[d.name]) / answers.seconds / d.spec.cores
                        for d in office.desks}
                rows.append({"round": r, "layout": layout, "users": users, "seconds": answers.seconds,
                             "tokens": sum(answers.completion_tokens), "tok_s": answers.tokens_per_s,
                             "ttft_s": median(answers.first_token_s), "busy": busy})
                say(f"  {layout} {users} users: {answers.tokens_per_s:.1f} tok/s, busy "
                    + ", ".join(f"{k} {v:.2f}" for k, v in busy.items()))
    await office.async_stop_rings()
    return rows


def measured_layout(name: str, desks: int) -> str | None:
    """The measured layout a proposal (`engine.placement.layouts.Layout.name`) is, or None: not measured."""
    return {"1 copy": "one", f"{desks} copies": "copies", f"1 ring of {desks}": "ring"}.get(name)


def layout_check(summary: list[dict[str, Any]], proposals: dict[int, list[dict[str, Any]]],
                 desks: int) -> list[dict[str, Any]]:
    """Per user count: the proposed layout (the first of ``proposals[users]``, best first, each with its
    name and predicted tok/s), what it measured, the measured best, and whether the proposal is the
    best or within LAYOUT_TOLERANCE of it."""
    out = []
    for users, alternatives in sorted(proposals.items()):
        measured = {s["layout"]: s["tok_s"] for s in summary if s["users"] == users}
        if not measured or not alternatives:
            continue
        proposed = alternatives[0]
        layout = measured_layout(proposed["name"], desks)
        best = max(measured, key=lambda k: measured[k])
        got = measured.get(layout) if layout is not None else None
        ok = got is not None and got >= (1 - LAYOUT_TOLERANCE) * measured[best]
        out.append({"users": users, "proposed": proposed["name"], "predicted_tok_s": proposed["tok_s_users"],
                    "measured_tok_s": got, "best": best, "best_tok_s": measured[best],
                    "verdict": ("the measured best" if layout == best else
                                f"within {LAYOUT_TOLERANCE:.0%} of the best" if ok else
                                "not measured here" if got is None else "miss")})
    return out


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = sorted({(r["layout"], r["users"]) for r in rows}, key=lambda k: (LAYOUTS.index(k[0]), k[1]))
    out = []
    for layout, users in keys:
        mine = [r for r in rows if r["layout"] == layout and r["users"] == users]
        desks = sorted(mine[0]["busy"])
        out.append({"layout": layout, "users": users, "tok_s": median([r["tok_s"] for r in mine]),
                    "ttft_s": median([r["ttft_s"] for r in mine]), "rounds": len(mine),
                    "busy": {d: median([r["busy"][d] for r in mine]) for d in desks}})
    one = {s["users"]: s["tok_s"] for s in out if s["layout"] == "one"}
    for s in out:
        s["vs_one"] = s["tok_s"] / one[s["users"]] if one.get(s["users"]) else None
    return out


def render(result: dict[str, Any], command: str) -> str:
    s = result["settings"]
    lines = [f"## Office: {s['desks']} emulated PCs against one (office)", "", f"    {command}", "",
             f"Each desk {s['cores']:g} core(s) and {s['memory_mb']} MiB in its own network namespace; "
             f"{s['tokens']} greedy tokens per user, distinct prompts; medians of {s['rounds']} round(s), layouts "
             f"rotated. Busy: a desk's CPU time over the round as a fraction of its share. Machine: "
             f"{result['machine']['cpu']}, load {result['machine']['load_average']}.", ""]
    rows = [[x["layout"], x["users"], f"{x['tok_s']:.1f}", f"{x['ttft_s']:.2f}",
             "—" if x["vs_one"] is None else f"{x['vs_one']:.2f}",
             ", ".join(f"{v:.2f}" for v in x["busy"].values())] for x in result["summary"]]
    lines.append(markdown_table(["layout", "users", "tok/s", "TTFT s", "× one PC", "desks busy"], rows))
    if result.get("layout_check"):
        lines += ["", "Copies or a ring, as placement proposes them (engine.placement.layouts over the fleet "
                  "service's placement of the same model) against what was measured:", ""]
        lines.append(markdown_table(
            ["users", "proposed", "predicted tok/s", "measured tok/s", "measured best", "check"],
            [[c["users"], c["proposed"], f"{c['predicted_tok_s']:.1f}",
              "—" if c["measured_tok_s"] is None else f"{c['measured_tok_s']:.1f}",
              f"{c['best']} {c['best_tok_s']:.1f}", c["verdict"]] for c in result["layout_check"]]))
    return "\n".join(lines) + "\n"


async def _async_run(args: argparse.Namespace, root: Path, one: Path,
                     ring: Path) -> tuple[list[dict[str, Any]], dict[int, list[dict[str, Any]]]]:
    from tests.support.office.office import Office, OfficeSpec, building
    from tests.support.office.pc import PcSpec

    spec = OfficeSpec(desks=tuple(PcSpec(f"desk-{i + 1}", cores=args.cores, memory_mb=args.memory_mb, display=False)
                                  for i in range(args.desks)),
                      server=PcSpec("server", cores=0.5, display=False),
                      people=PcSpec("people", cores=0.5, display=False))
    with building(spec, root) as pcs:
        async with Office(pcs, root) as office:
            started = time.perf_counter()
            await office.async_start_fleet(exact=False)
            await office.async_enrol(timeout=300)
            say(f"fleet up, {args.desks} desks enrolled in {time.perf_counter() - started:.0f} s")
            proposals = {} if args.no_layout_check else await _proposals(office, _ints(args.users))
            return await _measure(office, args, one, ring), proposals


async def _proposals(office, users: list[int]) -> dict[int, list[dict[str, Any]]]:
    """The layouts placement proposes for each user count, over the fleet service's placement of the
    default model on the desks (best first: name, kind, predicted tok/s at 1 and N users)."""
    from console.fleet.models import DEFAULT_MODEL_NAME
    from console.fleet_api.admin_decode import inputs_from_json
    from engine.placement.layouts import propose

    started = time.perf_counter()
    model = DEFAULT_MODEL_NAME  # the library's embedded default: the model the layouts are measured with
    placement = await office.async_placement(model, request={"objective": "throughput", "n_streams": max(users)})
    inputs = inputs_from_json(placement["inputs"])
    out = {}
    for n in users:
        choice = propose(inputs.model, inputs.pcs, inputs.devices, inputs.links.links, users=n, names=inputs.names)
        out[n] = [{"name": a.name, "kind": str(a.kind), "tok_s_one": a.tok_s_one, "tok_s_users": a.tok_s_users}
                  for a in choice.alternatives]
    say(f"placement proposes {[(n, v[0]['name'] if v else None) for n, v in out.items()]} "
        f"({time.perf_counter() - started:.0f} s)")
    return out


def run(args: argparse.Namespace) -> int:
    from tests.support.office.office import why_unavailable

    args = apply_quick(args)
    reason = why_unavailable()
    if reason is not None:
        print(f"office benchmark: cannot build an office here: {reason}", file=sys.stderr)
        return 2
    one, ring = _exports(args)
    with tempfile.TemporaryDirectory(prefix="bench-office-") as tmp:
        rows, proposals = asyncio.run(_async_run(args, Path(tmp), one, ring))
    summary = summarise(rows)
    result: dict[str, Any] = {"machine": machine_info(), "exports": [one.name, ring.name],
              "settings": {k: getattr(args, k) for k in ("desks", "cores", "memory_mb", "users", "tokens", "rounds",
                                                         "layouts", "weights", "quick")},
              "rounds": rows, "summary": summary, "proposals": {str(k): v for k, v in proposals.items()},
              "layout_check": layout_check(summary, proposals, args.desks)}
    command = command_line(args)
    text = render(result, command)
    print(text)
    json_path = args.json if args.json is not None else (None if args.quick else DEFAULT_JSON_DIR / "office.json")
    if json_path is not None:
        from tests.benchmarks.record import write_json

        write_json(json_path, result)
    if not args.quick:
        update_section(args.doc, "office", text)
    return 0


COMMAND = Command(name="office", help="N emulated PCs (own namespace, cores, memory) against one: one PC, copies "
                                      "and a ring placed by the fleet service, aggregate tok/s at N users",
                  configure=configure, run=run)
