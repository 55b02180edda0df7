"""fleet-scale: the fleet service holding 100 and 1,000 agents.

A real ``deskfleet fleet`` process on loopback (:class:`tests.support.service_process.ServiceProcess`,
its defaults: agents polled every 5 s, the mDNS browser on) and the simulated fleet
(:mod:`tests.support.sim_fleet`: fake agents in worker processes, real enrolment, real control API
over mutual TLS, registering every 30 s as the real agent does, pausing and resuming at random at
``--flap-per-s`` across the fleet). For each size: the enrolment (join tokens issued through the
admin API, joins, approvals: each a rate), then a steady window of ``--window`` s in which the
service's CPU (cores: its CPU time over the wall time, from /proc) and RSS (peak of 1 s samples)
are read, with the hub's registration round trip as the agents see it (p50 / p95: TLS handshake
+ ``POST /v1/register``). ``--tokens`` reusable uses one join token of N uses with auto-approval
(no approvals through the API); ``both`` measures the two in turn at each size.

The load generators run on the same machine as the service (their CPU is recorded too): on a
small machine they compete with it, so a figure near the machine's core count is a ceiling, not
a measurement. ``--profile DIR`` runs the service under cProfile instead (slower; for finding
what to fix, not for the figures) and writes one .prof per size there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.cli.main import Command
from tests.benchmarks.record import machine_info, markdown_table, update_section, write_json

NAME = "fleet-scale"
DEFAULT_JSON = Path("docs/bench/fleet-scale.json")
DEFAULT_DOC = Path("docs/BENCHMARKS.md")
TARGET_CORES = 1.0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _cpu_s(proc) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _group_cpu_s(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += _cpu_s(psutil.Process(pid))
    return total


async def _async_one(n: int, tokens: str, code: Path | None, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import psutil

    from tests.support.service_process import ServiceProcess
    from tests.support.sim_fleet import SimFleet

    label = "this tree" if code is None else args.baseline_label
    run_dir = root / f"n{n}-{tokens}-{'base' if code is not None else 'this'}"
    run_dir.mkdir(parents=True)
    python_args: tuple[str, ...] = ()
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        python_args = ("-m", "cProfile", "-o", str(args.profile / f"service-{n}-{tokens}.prof"))
    service = ServiceProcess(run_dir / "fleet", run_dir / "service.log", python_args=python_args, code=code)
    admin = await service.start(timeout=120)
    await admin.close()
    proc = psutil.Process(service.proc.pid)
    sim = SimFleet(run_dir / "fleet", agents=n, flap_per_s=args.flap_per_s, register_s=args.register_s,
                   tokens=tokens, prefix=f"fs{os.getpid() % 1000}-{n}",
                   on_progress=lambda line: print(f"  [{n} {tokens} {label}] {line}", flush=True))
    try:
        cpu0, wall0 = _cpu_s(proc), time.perf_counter()
        await sim.async_start(timeout=args.setup_timeout)
        enrol_cpu, enrol_wall = _cpu_s(proc) - cpu0, time.perf_counter() - wall0
        st = sim.stats
        print(f"  [{n} {tokens}] enrolled in {enrol_wall:.1f} s; settling {args.settle:g} s", flush=True)
        await asyncio.sleep(args.settle)
        reg0, polls0, flaps0 = len(st.registered), st.total_polls, st.total_flaps
        cpu0, sim_cpu0, wall0 = _cpu_s(proc), _group_cpu_s(sim.pids), time.perf_counter()
        rss_peak = 0
        while (elapsed := time.perf_counter() - wall0) < args.window:
            rss_peak = max(rss_peak, proc.memory_info().rss)
            await asyncio.sleep(min(1.0, args.window - elapsed))
        await asyncio.sleep(1.2)  # the workers' last stats of the window
        cpu, sim_cpu, wall = _cpu_s(proc) - cpu0, _group_cpu_s(sim.pids) - sim_cpu0, time.perf_counter() - wall0
        window_reg = st.registered[reg0:]
        agents = (await sim.admin.async_agents())["agents"]
        ours = set(st.joined.values())
        listed = [a for a in agents if a["node_id"] in ours]
        result = {
            "agents": n, "tokens": tokens, "service_code": label, "processes": sim.processes,
            "flap_per_s": args.flap_per_s,
            "register_s": args.register_s, "window_s": round(wall, 1), "profiled": args.profile is not None,
            "service_cores": cpu / wall, "service_rss_mb": rss_peak / 2**20,
            "sim_cores": sim_cpu / wall,
            "register_p50_ms": 1000 * _pct(window_reg, 0.5), "register_p95_ms": 1000 * _pct(window_reg, 0.95),
            "registrations": len(window_reg), "register_failed": st.register_failed,
            "polls_per_s": (st.total_polls - polls0) / wall, "flaps": st.total_flaps - flaps0,
            "token_s": st.token_s, "tokens_per_s": n / st.token_s if st.token_s else None,
            "join_p50_ms": 1000 * _pct(st.join_s, 0.5), "join_p95_ms": 1000 * _pct(st.join_s, 0.95),
            "joins_per_s": n / st.join_wall_s, "approve_s": st.approve_s,
            "approvals_per_s": n / st.approve_s if st.approve_s else None,
            "enrol_wall_s": enrol_wall, "enrol_service_cores": enrol_cpu / enrol_wall,
            "listed": len(listed), "approved": sum(1 for a in listed if a["approved"]),
            "errors": st.errors[:5],
        }
        print(f"  [{n} {tokens}] service {result['service_cores']:.2f} cores, {result['service_rss_mb']:.0f} MB; "
              f"register p50 {result['register_p50_ms']:.0f} ms p95 {result['register_p95_ms']:.0f} ms; "
              f"{result['polls_per_s']:.0f} polls/s", flush=True)
        return result
    finally:
        await sim.async_stop()
        await service.stop()


def _profile_top(path: Path, limit: int = 12) -> list[str]:
    import io

    out = io.StringIO()
    pstats.Stats(str(path), stream=out).sort_stats("tottime").print_stats(limit)
    return [line for line in out.getvalue().splitlines() if line.strip()][-limit:]


def _markdown(argv: str, results: list[dict[str, Any]], machine: dict[str, Any], note: str) -> str:
    rows = [[r["agents"], r["tokens"], r["service_code"], f"{r['service_cores']:.2f}", f"{r['service_rss_mb']:.0f}",
             f"{r['register_p50_ms']:.0f} / {r['register_p95_ms']:.0f}", f"{r['polls_per_s']:.0f}",
             f"{r['sim_cores']:.2f}", f"{r['join_p50_ms']:.0f} / {r['join_p95_ms']:.0f}", f"{r['joins_per_s']:.1f}",
             "-" if r["tokens_per_s"] is None or r["tokens"] == "reusable" else f"{r['tokens_per_s']:.0f}",
             "auto" if r["approvals_per_s"] is None else f"{r['approvals_per_s']:.0f}",
             f"{r['approved']}/{r['agents']}"] for r in results]
    table = markdown_table(["agents", "tokens", "service", "service cores", "service RSS MB", "register p50 / p95 ms",
                            "polls/s", "sim cores", "join p50 / p95 ms", "joins/s", "tokens/s", "approvals/s",
                            "approved"], rows)
    worst = max((r["service_cores"] for r in results if r["agents"] >= 1000 and r["service_code"] == "this tree"),
                default=None)
    verdict = ("" if worst is None else
               f"\nAt 1,000 agents the service used {worst:.2f} cores at most: the target (< {TARGET_CORES:g} core) "
               f"is {'met' if worst < TARGET_CORES else 'missed'}.\n")
    return (f"## Fleet scale: the fleet service with 100 and 1,000 agents\n\n`{argv}`\n\n"
            f"A real `deskfleet fleet` process on loopback; simulated agents (tests/support/sim_fleet) in worker "
            f"processes on the same machine, each with its own key and fleet certificate from the real enrolment, "
            f"its real control API over mutual TLS (polled by the service every 5 s), registering every "
            f"{results[0]['register_s']:g} s and pausing/resuming at random, {results[0]['flap_per_s']:g} times a "
            f"second across the fleet. Service cores: its CPU time over a {results[0]['window_s']:g} s steady window "
            f"(from /proc); RSS: the window's peak. Register: the hub's round trip (TLS handshake + "
            f"`POST /v1/register`) as the agents see it. Join: one agent's enrolment (CA fetch, CSR, certificate). "
            f"Tokens/s and approvals/s: through the admin API, one call each. Sim cores: the load generators' own "
            f"CPU, taken from the same {machine['cores']} cores. Machine: {machine['cpu']}, {machine['cores']} cores, "
            f"load average {machine['load_average']} at the end.\n\n{table}\n{verdict}{note}")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agents", type=int, nargs="+", default=[100, 1000], help="fleet sizes (default 100 1000)")
    p.add_argument("--tokens", choices=("single", "reusable", "both"), default="single",
                   help="single-use tokens (one per agent, approved through the API), one reusable auto-approve "
                        "token, or both in turn (default single)")
    p.add_argument("--window", type=float, default=60.0, help="steady-state seconds measured (default 60: two "
                                                               "registration intervals)")
    p.add_argument("--settle", type=float, default=10.0,
                   help="seconds after the enrolment before the window (default 10)")
    p.add_argument("--flap-per-s", type=float, default=2.0,
                   help="pauses + resumes per second across the fleet (default 2)")
    p.add_argument("--register-s", type=float, default=30.0,
                   help="registration interval (default 30, the real agent's)")
    p.add_argument("--setup-timeout", type=float, default=900.0, help="seconds allowed for the enrolment (default 900)")
    p.add_argument("--profile", type=Path, default=None,
                   help="run the service under cProfile and write its .prof files to this directory")
    p.add_argument("--baseline", type=Path, default=None,
                   help="also run the service from this source tree (e.g. `git archive COMMIT | tar -x -C DIR`), "
                        "interleaved with this tree's at each size")
    p.add_argument("--baseline-label", default="baseline", help="what --baseline is, for the table (e.g. a commit)")
    p.add_argument("--note", default="", help="a line added under the table (what changed since the last run)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"raw results (default {DEFAULT_JSON})")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help=f"the Markdown to update (default {DEFAULT_DOC})")


def run(args: argparse.Namespace) -> int:
    from engine.envvars import KEYRING_DIR

    if any(n < 1 for n in args.agents):
        raise SystemExit("--agents: every size must be at least 1")
    variants = ("single", "reusable") if args.tokens == "both" else (args.tokens,)
    results = []
    with tempfile.TemporaryDirectory(prefix="deskfleet-fleet-scale-") as tmp:
        root = Path(tmp)
        os.environ[KEYRING_DIR] = str(root / "keyring")  # never the user's keyring
        codes = (None,) if args.baseline is None else (args.baseline.resolve(), None)
        for n in args.agents:
            for tokens in variants:  # interleaved: every variant at one size before the next size
                for code in codes:
                    print(f"fleet-scale: {n} agents, {tokens} tokens, service from "
                          f"{'this tree' if code is None else code}", flush=True)
                    results.append(asyncio.run(_async_one(n, tokens, code, args, root)))
    machine = machine_info()
    data: dict[str, Any] = {"machine": machine, "results": results}
    if args.profile is not None:
        data["profile_top"] = {p.name: _profile_top(p) for p in sorted(args.profile.glob("*.prof"))}
        write_json(args.profile / "fleet-scale-profile.json", data)
        print(f"profiled run: not recorded in {args.doc}; see {args.profile}")
        return 0
    write_json(args.json, data)
    sizes = " ".join(str(n) for n in args.agents)
    argv = (f"python -m tests.benchmarks fleet-scale --agents {sizes} --tokens {args.tokens} --window {args.window:g} "
            f"--flap-per-s {args.flap_per_s:g}"
            + (f" --baseline DIR --baseline-label {args.baseline_label}" if args.baseline is not None else ""))
    update_section(args.doc, NAME, _markdown(argv, results, machine, args.note))
    return 0


COMMAND = Command(name=NAME, help="the fleet service's CPU, RSS and registration latency with 100 and 1,000 "
                                   "simulated agents", configure=configure, run=run)
