"""console-fleet: how long the console's GUI thread is blocked per Fleet-page refresh while a
fleet of simulated agents changes state, at 100 and 1,000 agents, the old page against the new.

A real ``deskfleet fleet`` service process on loopback; the simulated fleet
(tests/support/sim_fleet: fake agents in worker processes speaking the real enrolment, hub and
control protocol with mutual TLS, registering every 30 s and pausing/resuming themselves at
``--flap-per-s`` pauses + resumes per second across the fleet); and, for each measurement, a
console process under Xvfb (tests/benchmarks/console_fleet_probe.py: the real window on the Fleet
page, attached over the admin socket). Variants, interleaved run by run:

- ``old``: the page before the Qt model (a `QTableWidget` rebuilt per snapshot, every snapshot
  decoded on the GUI thread: tests/benchmarks/console_fleet_old.py);
- ``new``: `console.qt.fleet_table_model` (diffs, coalesced to one apply per 250 ms, snapshots
  decoded on the bridge's loop thread).

Figures: a heartbeat timer every 5 ms stamps the event loop; a refresh's block is the longest
stall (gap between stamps minus 5 ms) from the refresh's start to 200 ms after it (its paint
included); "lag" is every stall of the run. Target (issue 16): p95 block per refresh <= 200 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.cli.main import Command

WINDOW_S = 0.2  # a refresh's block: the longest stall within this long of its start
TARGET_P95_MS = 200.0
VARIANTS = ("old", "new")
OLD_MAX_AGENTS = 100


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` (0..100) percentile, nearest rank (nan for none)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))])


def stalls(beats: Sequence[float], beat_s: float) -> list[tuple[float, float]]:
    """(start, stall seconds) for each gap between heartbeat stamps: the gap less the interval."""
    return [(a, max(0.0, b - a - beat_s)) for a, b in zip(beats, beats[1:], strict=False)]


def refresh_blocks(beats: Sequence[float], starts: Sequence[float], beat_s: float,
                   window_s: float = WINDOW_S) -> list[float]:
    """Per refresh started at ``starts``: the longest stall of the gaps from the one the refresh
    began in to those beginning up to ``window_s`` later (seconds). Refreshes outside the
    stamped span are left out."""
    gaps = stalls(beats, beat_s)
    out = []
    for t in starts:
        i = bisect.bisect_right(beats, t) - 1
        if i < 0 or i >= len(gaps):
            continue
        worst = 0.0
        while i < len(gaps) and gaps[i][0] < t + window_s:
            worst = max(worst, gaps[i][1])
            i += 1
        out.append(worst)
    return out


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """One probe's JSON -> its figures (milliseconds)."""
    beat_s = raw["beat_s"]
    # the heartbeat started at "start" and should have stamped until "end": a loop too busy to
    # stamp at all still shows as one stall
    beats = [raw["start"], *raw["beats"], raw["end"]]
    span = max(1e-9, raw["end"] - raw["start"])
    refresh = [(s, e) for s, e in raw["refresh"] if raw["start"] <= s <= raw["end"]]
    receive = [(s, e) for s, e in raw["receive"] if raw["start"] <= s <= raw["end"]]
    blocks = [1000 * b for b in refresh_blocks(beats, [s for s, _ in refresh], beat_s)]
    lag = [1000 * g for _, g in stalls(beats, beat_s)]
    return {"variant": raw["variant"], "agents": raw["agents"], "rows": raw["rows"], "seconds": span,
            "platform": raw.get("platform", ""), "refreshes": len(refresh), "snapshots": len(receive),
            "blocks_ms": blocks, "refresh_ms": [1000 * (e - s) for s, e in refresh],
            "receive_ms": [1000 * (e - s) for s, e in receive], "lag_p95_ms": percentile(lag, 95),
            "lag_max_ms": max(lag, default=float("nan")), "cpu_cores": raw["cpu_s"] / span,
            "pyside": raw.get("pyside", ""), "none_refs_per_s": _none_drift(raw, span)}


def _none_drift(raw: dict[str, Any], span: float) -> float:
    """How fast the console's references to None changed over the run (per second; negative: PySide6's
    lost references, see console/qt/fleet_page.py)."""
    refs = raw.get("none_refs")
    return float("nan") if not refs else (refs[1] - refs[0]) / span


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs of one (agents, variant) together: blocks pooled, rates and CPU as medians."""
    from tests.benchmarks.record import median

    blocks = [b for r in runs for b in r["blocks_ms"]]
    handler = [b for r in runs for b in r["refresh_ms"]]
    seconds = sum(r["seconds"] for r in runs)
    return {"refreshes_per_s": sum(r["refreshes"] for r in runs) / seconds,
            "snapshots_per_s": sum(r["snapshots"] for r in runs) / seconds,
            "block_p50_ms": percentile(blocks, 50), "block_p95_ms": percentile(blocks, 95),
            "block_max_ms": max(blocks, default=float("nan")), "handler_p50_ms": percentile(handler, 50),
            "handler_p95_ms": percentile(handler, 95), "lag_p95_ms": median([r["lag_p95_ms"] for r in runs]),
            "lag_max_ms": max(r["lag_max_ms"] for r in runs), "cpu_cores": median([r["cpu_cores"] for r in runs]),
            "none_refs_per_s": median([r["none_refs_per_s"] for r in runs]), "runs": len(runs)}


def render(args: argparse.Namespace, table: dict[tuple[int, str], dict[str, Any]], platform: str,
           flaps_per_s: dict[int, float], pyside: str = "",
           failed: dict[tuple[int, str], list[str]] | None = None) -> str:
    from tests.benchmarks.kit import verdict
    from tests.benchmarks.record import markdown_table

    rows = []
    for (agents, variant), f in sorted(table.items(), key=lambda kv: (kv[0][0], VARIANTS.index(kv[0][1]))):
        rows.append([agents, variant, f"{flaps_per_s.get(agents, float('nan')):.1f}", f"{f['snapshots_per_s']:.1f}",
                     f"{f['refreshes_per_s']:.1f}", f"{f['block_p50_ms']:.0f}", f"{f['block_p95_ms']:.0f}",
                     f"{f['block_max_ms']:.0f}", f"{f['handler_p50_ms']:.1f}", f"{f['handler_p95_ms']:.1f}",
                     f"{f['lag_p95_ms']:.0f}", f"{f['lag_max_ms']:.0f}", f"{f['cpu_cores']:.2f}",
                     f"{f['none_refs_per_s']:+.0f}", verdict(f["block_p95_ms"], TARGET_P95_MS, higher=False)])
    ratios = []
    for agents in sorted({a for a, _ in table}):
        old, new = table.get((agents, "old")), table.get((agents, "new"))
        if old and new and new["block_p95_ms"] > 0:
            ratios.append(f"{agents} agents: p95 block old/new = {old['block_p95_ms'] / new['block_p95_ms']:.1f}×")
    command = " ".join(["python -m tests.benchmarks console-fleet", *sys.argv[2:]]) if sys.argv[1:2] == [
        "console-fleet"] else "python -m tests.benchmarks console-fleet"
    return "\n".join([
        "## Console Fleet page at 100 and 1,000 agents (console-fleet)", "", f"    {command}", "",
        f"A real `deskfleet fleet` process, the simulated fleet (tests/support/sim_fleet: fake agents in worker "
        f"processes over the real enrolment, hub and control API with mutual TLS, registering every 30 s, pausing "
        f"and resuming themselves at {args.flap_per_s:g} changes/s fleet-wide; the console's own status refresh "
        f"every 5 s) and the real console window on the Fleet page in a process of its own (Qt platform: "
        f"{platform}), {args.seconds:g} s per run, {args.runs} run(s) per variant, interleaved. `old`: the page "
        f"before the Qt model (QTableWidget rebuilt per snapshot, snapshots decoded on the GUI thread); `new`: "
        f"console/qt/fleet_table_model.py (diff updates coalesced to one per 250 ms, decoding on the loop thread). "
        f"A 5 ms heartbeat timer stamps the GUI thread's event loop; a refresh's block is the longest stall "
        f"within 200 ms of its start (its paint included); lag is every stall of the run; handler is the "
        f"refresh's own slot time. Target: p95 block per refresh <= {TARGET_P95_MS:.0f} ms. PySide6 {pyside}; "
        f"\"None refs/s\" is how fast the console process's references to None moved (PySide6 6.12.0 on "
        f"CPython 3.11 drops one per void Qt call, and the process aborts when they run out).", "",
        markdown_table(["agents", "page", "changes/s", "snapshots/s", "refreshes/s", "block p50 ms", "block p95 ms",
                        "block max ms", "handler p50 ms", "handler p95 ms", "lag p95 ms", "lag max ms",
                        "console CPU cores", "None refs/s", "p95 ≤ 200 ms"], rows), "",
        "; ".join(ratios) + ("." if ratios else ""),
        *([f"\nThe old page is run up to {args.old_max_agents} agents only: a refresh of it replaces every "
           f"QTableWidgetItem of columns sized to their contents, which grows with the square of the rows "
           f"(minutes at 1,000)."] if "old" in args.variants and max(args.agents) > args.old_max_agents else []),
        *[f"\n{variant} page at {agents} agents: the console died in {len(whys)} run(s): {whys[0]}"
          for (agents, variant), whys in sorted((failed or {}).items())],
    ])


class ProbeFailed(Exception):
    """The console process ended without its figures (``why``: its exit and first error line)."""

    def __init__(self, why: str, output: str) -> None:
        super().__init__(why)
        self.why, self.output = why, output


async def _probe(state: Path, agents: int, variant: str, args: argparse.Namespace, work: Path,
                 screenshot: Path | None = None) -> dict[str, Any]:
    from tests.support.xvfb import XVFB

    out = work / f"probe-{agents}-{variant}-{uuid.uuid4().hex[:6]}.json"
    probe = [sys.executable, "-m", "tests.benchmarks.console_fleet_probe", "--state-dir", str(state),
             "--agents", str(agents), "--variant", variant, "--seconds", str(args.seconds), "--out", str(out)]
    if screenshot is not None:
        probe += ["--screenshot", str(screenshot)]
    argv = [*XVFB, "env", "QT_QPA_PLATFORM=xcb", *probe] if args.xvfb else probe
    env = dict(os.environ, QT_QPA_PLATFORM="xcb" if args.xvfb else "offscreen")
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), args.seconds + 900)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise ProbeFailed(f"did not finish in {args.seconds + 900:g} s", "") from None
    if proc.returncode != 0 or not out.is_file():
        text = output.decode(errors="replace")
        lines = [line for line in text.splitlines() if line.strip()]
        why = next((line for line in lines if line.startswith(("Fatal Python error", "Traceback"))), "")
        raise ProbeFailed(f"exit {proc.returncode}: {why or (lines[-1] if lines else 'no output')}", text)
    return json.loads(out.read_text())


async def measure(args: argparse.Namespace, work: Path, say=print) -> dict[str, Any]:
    """Every (agents, run, variant): the raw probes' summaries, the sim fleets' change rates."""
    from tests.support.service_process import ServiceProcess
    from tests.support.sim_fleet import SimFleet

    runs: list[dict[str, Any]] = []
    flaps: dict[int, float] = {}
    for agents in args.agents:
        state = work / f"fleet-{agents}"
        service = ServiceProcess(state, work / f"service-{agents}.log", mdns=False)
        await (await service.start(timeout=120)).close()
        try:
            say(f"[console-fleet] {agents} simulated agents joining…")
            async with SimFleet(state, agents=agents, flap_per_s=args.flap_per_s,
                                prefix=f"cf{agents}-{uuid.uuid4().hex[:4]}", on_progress=say) as sim:
                started, flapped = time.monotonic(), sim.stats.total_flaps
                for run in range(args.runs):
                    order = VARIANTS if run % 2 == 0 else tuple(reversed(VARIANTS))
                    for variant in (v for v in order if v in args.variants):
                        if variant == "old" and agents > args.old_max_agents:
                            continue  # one old refresh grows with the square of the rows: minutes at 1,000
                        shot = args.screenshot if (args.screenshot and variant == "new" and run == 0
                                                   and agents == args.agents[-1]) else None
                        say(f"[console-fleet] {agents} agents, run {run + 1}/{args.runs}, {variant} page…")
                        try:
                            raw = await _probe(state, agents, variant, args, work, shot)
                        except ProbeFailed as exc:  # a result too: the console died under this load
                            runs.append({"variant": variant, "agents": agents, "run": run, "failed": exc.why})
                            say(f"[console-fleet]   the console failed: {exc.why}")
                            continue
                        summary = summarise(raw)
                        summary["run"] = run
                        runs.append(summary)
                        say(f"[console-fleet]   p95 block {percentile(summary['blocks_ms'], 95):.0f} ms over "
                            f"{summary['refreshes']} refreshes, {summary['snapshots']} snapshots")
                flaps[agents] = (sim.stats.total_flaps - flapped) / max(1e-9, time.monotonic() - started)
        finally:
            await service.stop()
    return {"runs": runs, "flaps_per_s": flaps}


def configure(p: argparse.ArgumentParser) -> None:
    from tests.benchmarks.record import DEFAULT_DOC, DEFAULT_JSON_DIR

    p.add_argument("--agents", type=lambda s: [int(x) for x in s.split(",")], default=[100, 1000],
                   help="fleet sizes, comma-separated (default 100,1000)")
    p.add_argument("--flap-per-s", type=float, default=5.0,
                   help="pauses + resumes per second across the simulated fleet (default 5)")
    p.add_argument("--seconds", type=float, default=30.0, help="measured seconds per run (default 30)")
    p.add_argument("--runs", type=int, default=2, help="runs per variant, interleaved (default 2)")
    p.add_argument("--variants", type=lambda s: tuple(s.split(",")), default=VARIANTS,
                   help="old,new (default both)")
    p.add_argument("--old-max-agents", type=int, default=OLD_MAX_AGENTS,
                   help=f"run the old page only up to this many agents (default {OLD_MAX_AGENTS}: one of its "
                        "refreshes takes minutes at 1,000)")
    p.add_argument("--no-xvfb", dest="xvfb", action="store_false",
                   help="run the console offscreen instead of under Xvfb")
    p.add_argument("--screenshot", type=Path, help="save the new page at the largest size as this PNG")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "console-fleet.json", help="the raw results")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown file whose section is rewritten")


def run(args: argparse.Namespace) -> int:
    from engine.envvars import KEYRING_DIR
    from tests.benchmarks.record import machine_info, update_section, write_json
    from tests.support.xvfb import xvfb_works

    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.agents or min(args.agents) < 1 or args.runs < 1 or args.seconds <= 0:
        print(f"console-fleet: variants are {VARIANTS} (not {bad}); agents, runs and seconds must be positive",
              file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="deskfleet-console-fleet-"))
    private = {KEYRING_DIR: work / "keyring", "XDG_CONFIG_HOME": work / "config", "XDG_DATA_HOME": work / "data"}
    saved = {k: os.environ.get(k) for k in private}
    os.environ.update({k: str(v) for k, v in private.items()})
    try:
        if args.xvfb and not xvfb_works(dict(os.environ)):
            print("console-fleet: Xvfb does not start a Qt application here; measuring offscreen", file=sys.stderr)
            args.xvfb = False
        measured = asyncio.run(measure(args, work, lambda line: print(line, file=sys.stderr, flush=True)))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(work, ignore_errors=True)
    table, failed = {}, {}
    for agents in args.agents:
        for variant in args.variants:
            mine = [r for r in measured["runs"] if r["agents"] == agents and r["variant"] == variant]
            ok = [r for r in mine if "failed" not in r]
            if ok:
                table[(agents, variant)] = pooled(ok)
            if len(ok) < len(mine):
                failed[(agents, variant)] = [r["failed"] for r in mine if "failed" in r]
    platform = "xcb under Xvfb" if args.xvfb else "offscreen"
    write_json(args.json, {"machine": machine_info(), "flap_per_s": args.flap_per_s, "seconds": args.seconds,
                           "platform": platform, "flaps_measured_per_s": measured["flaps_per_s"],
                           "table": [{"agents": a, "variant": v, **f} for (a, v), f in table.items()],
                           "runs": measured["runs"]})
    pyside = ", ".join(sorted({r["pyside"] for r in measured["runs"] if r.get("pyside")}))
    update_section(args.doc, "console-fleet", render(args, table, platform, measured["flaps_per_s"], pyside,
                                                      failed))
    for (agents, variant), f in table.items():
        print(f"{agents:>5} agents  {variant}: block p50 {f['block_p50_ms']:.0f} ms, p95 {f['block_p95_ms']:.0f} ms, "
              f"max {f['block_max_ms']:.0f} ms; {f['refreshes_per_s']:.1f} refreshes/s")
    return 0


COMMAND = Command(name="console-fleet", help="the console's GUI-thread block per Fleet-page refresh at 100 and "
                  "1,000 simulated agents (old page vs new, under Xvfb)", configure=configure, run=run)
