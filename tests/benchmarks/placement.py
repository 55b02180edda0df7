"""``python -m tests.benchmarks placement``: does the placement solver's prediction hold on a real
ring?

The model is placed over groups of 1, 2 and 3 local headless agents (in-process `AgentService`s
on loopback, joined to one fleet host; each group approved by its own console state, so each
`async_place` sees only its group). Devices are calibrated one agent at a time: on this machine
the agents share its cores, and `async_place` calibrates agents concurrently (right for separate
PCs, not here). For one stream the solver puts the whole model on one agent (loopback hops cost
almost nothing), so the 2- and 3-agent plans are its *throughput* plans for 2 and 3 streams
with one stage per agent (`min_stages`: the group is there to check a split, which the solver
would skip where a split gains nothing); their one-stream prediction (`Plan.per_token_ms`) is
what is checked, on one stream.

Each plan is exported with its own split and distributed (`Distributor`, one inference thread
per worker); one stream of greedy tokens goes through each ring in turn, rounds interleaved.
Measured per stage: the worker process's CPU time per decode token, against the plan's
per-stage compute; the rest of a token's time (transport, coordinator, wake-ups) against the
plan's hop latencies. The agents calibrate with the workers' thread count (as the console does
with its worker settings); a diagnostic re-predicts every split from calibration stages timed
here in-process on one thread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from engine.cli.main import Command
from tests.benchmarks.placement_report import fit_stage_cpu, render
from tests.benchmarks.record import machine_info, median, update_section, write_json
from tests.support.loopback import free_port

if TYPE_CHECKING:
    from engine.placement.types import Plan

COMMAND_LINE = "python -m tests.benchmarks placement"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass(frozen=True)
class PlacementBench:
    """What to measure. ``model`` is an HF checkpoint directory (None: the embedded default);
    ``library`` keeps the calibration and plan exports between runs."""

    model: Path | None
    library: Path
    weights: str = "int4"
    group_size: int = 64
    agent_counts: tuple[int, ...] = (1, 2, 3)
    tokens: int = 128
    runs: int = 5
    warmups: int = 1
    threads: int = 1
    calibration_steps: int = 16
    plan_streams: int | None = None  # streams the multi-agent plans are made for; None: one per agent
    prompt_ids: tuple[int, ...] | None = None  # None: PROMPT through the model's chat template


# -- pure: a split's times under a calibration ----------------------------------------------------

def predict(plan: Plan, profiles: Sequence[tuple[float, float]], head_ratio: float) -> tuple[list[float], float]:
    """Per-stage and per-token ms of ``plan``'s split when stage k's device has
    ``profiles[k]`` = (layer_ms, overhead_ms); the head costs ``head_ratio`` layers (as
    `console.fleet.profiling.device_profiles` estimates it) and the hops are the plan's."""
    last = len(plan.stages) - 1
    stages = [s.n_layers * t + o + (head_ratio * t if k == last else 0.0)
              for k, (s, (t, o)) in enumerate(zip(plan.stages, profiles, strict=True))]
    return stages, sum(stages) + sum(plan.hop_ms)


def error_pct(predicted: float, measured: float) -> float:
    return 100.0 * (predicted - measured) / measured


def _plan_dict(plan: Plan) -> dict[str, Any]:
    return {"objective": plan.objective, "n_streams": plan.n_streams, "optimal": plan.optimal,
            "per_token_ms": plan.per_token_ms, "tok_s": plan.tok_s, "hop_ms": list(plan.hop_ms),
            "aggregate_tok_s": plan.aggregate_tok_s,
            "stages": [{"pc_id": s.pc_id, "device_id": s.device_id, "first_layer": s.first_layer,
                        "last_layer": s.last_layer, "compute_ms": s.compute_ms} for s in plan.stages]}


# -- the edges: agents, placement, rings ------------------------------------------------------------

def _cpu_s(pid: int) -> float:
    """CPU seconds of a process and its children: the scheduler's nanosecond count per thread
    (/proc/PID/task/*/schedstat), where psutil's clock-tick counts would read a tiny model's few
    milliseconds per run as 0 or 10 ms."""
    total = 0.0
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        for p in (proc, *proc.children(recursive=True)):
            total += _process_cpu_s(p)
    return total


def _process_cpu_s(p: psutil.Process) -> float:
    try:
        tasks = list(Path(f"/proc/{p.pid}/task").iterdir())
    except OSError:
        tasks = []
    ns = 0
    for task in tasks:
        with contextlib.suppress(OSError, ValueError, IndexError):
            ns += int((task / "schedstat").read_text().split()[0])
    if ns:
        return ns / 1e9
    with contextlib.suppress(psutil.Error):
        t = p.cpu_times()
        return t.user + t.system
    return 0.0


@contextlib.asynccontextmanager
async def _agents(root: Path, host, names: Sequence[str]):
    """Started agents on loopback, joined to ``host``; closed on exit."""
    from agent.service.idle import FakeIdle
    from agent.service.service import AgentService
    from agent.service.settings import AgentSettings

    started = []
    try:
        for name in names:
            settings = AgentSettings(name=name, interface="127.0.0.1", control_port=0, data_port=0)
            agent = AgentService(root / name, settings, idle_source=FakeIdle(1e6), power=lambda: None)
            await agent.async_start()
            started.append(agent)
            await agent.async_join(host.enrollment, host.token())
        yield started
    finally:
        for agent in started:
            await agent.async_close()


async def _async_place_group(state_dir: Path, host, agents, checkpoint: Path, options, calibration,
                             steps: int, streams: int | None,
                             threads: int | None) -> tuple[Plan, Plan, dict[str, tuple[float, float]]]:
    """(latency plan, measured plan, (layer_ms, overhead_ms) by node) over ``agents`` only."""
    from console.fleet.fleet import FleetModel
    from console.fleet.links import async_measure_links
    from console.fleet.placement_inputs import async_place
    from console.fleet.profiling import (
        ProfileCache,
        async_calibrate_devices,
        cache_device,
    )
    from engine.placement.types import PlacementRequest

    fleet = FleetModel(state_dir, host.credentials)
    nodes = []
    for agent in agents:
        record = await fleet.async_add_address("127.0.0.1", agent.control_port)
        fleet.approve(record.node_id)
        nodes.append(record.node_id)
    await fleet.async_refresh()
    cache = ProfileCache(state_dir)
    for node in nodes:  # one agent at a time: they share this machine's cores
        done = await async_calibrate_devices(fleet, host.hub, calibration, [node], cache, steps=steps,
                                             threads=threads)
        if done.failures:
            raise RuntimeError(f"calibration failed: {dict(done.failures)}")
    links = await async_measure_links(fleet, nodes)
    place = dict(options=options, links=links, steps=steps, threads=threads)
    latency = await async_place(fleet, host.hub, checkpoint, **place)
    plan = latency
    if len(agents) > 1:
        # One stage per agent: on loopback a measured split can be no faster than one agent
        # (noise in a tiny model's per-layer time), and the group is here to check a split.
        request = PlacementRequest("throughput", n_streams=streams or len(agents),
                                   min_stages=len(agents), max_stages=len(agents))
        plan = await async_place(fleet, host.hub, checkpoint, request=request, **place)
    profiles = {n: ProfileCache(state_dir).get(calibration.key, n, cache_device("CPU", threads)) for n in nodes}
    return latency, plan, profiles


def one_thread_profile(calibration, steps: int) -> tuple[float, float]:
    """(layer_ms, overhead_ms) from the calibration stages timed here on one inference thread."""
    from engine.shards.calibration import fit_layer_time, time_stage

    return fit_layer_time([time_stage(part.path, i, steps=steps, threads=1)
                           for part in calibration.parts for i in part.stages])


async def _timed_request(coordinator, prompt: tuple[int, ...], tokens: int, pids: Sequence[int]) -> dict[str, Any]:
    """One greedy stream: decode ms per token, and each worker's CPU ms per decode token."""
    from engine.generation.request import GenerationRequest

    arrivals: list[float] = []
    cpu0: list[float] = []
    request = GenerationRequest(prompt, tokens, ignore_eos=True)
    started = time.perf_counter()
    async with contextlib.aclosing(coordinator.stream(request)) as events:
        async for _ in events:
            arrivals.append(time.perf_counter())
            if len(arrivals) == 1:
                cpu0 = [_cpu_s(p) for p in pids]
    cpu1 = [_cpu_s(p) for p in pids]
    steps = len(arrivals) - 1
    ms = 1000 * (arrivals[-1] - arrivals[0]) / steps
    return {"tokens": len(arrivals), "ttft_ms": 1000 * (arrivals[0] - started), "ms_per_token": ms,
            "tok_s": 1000 / ms, "stage_cpu_ms": [1000 * (b - a) / steps for a, b in zip(cpu0, cpu1, strict=True)]}


async def async_run_bench(work: Path, bench: PlacementBench) -> dict[str, Any]:
    """Place, export, distribute and measure every group of ``bench.agent_counts`` agents."""
    from console.fleet.calibration_export import (
        CALIBRATION_DIR,
        async_build_calibration_set,
        layer_weight_bytes,
        model_profile,
    )
    from console.fleet.distribution import Distributor
    from console.fleet.models import ModelLibrary
    from console.fleet.ring_layout import AgentEndpoint, RingLayout
    from console.fleet_api.exports import ExportSpec
    from engine.control.fleet_services import fleet_host
    from engine.control.messages import WorkerSettings
    from engine.generation.tokenizer import ChatTokenizer
    from export.exporter import ExportOptions
    from export.sources import resolve_model

    source = resolve_model(None if bench.model is None else str(bench.model))
    checkpoint = source.checkpoint_dir
    options = ExportOptions(weights=bench.weights, group_size=bench.group_size)
    spec = ExportSpec(options.weights, options.group_size, options.symmetric, options.kv_cache_precision)
    calibration = await async_build_calibration_set(checkpoint, bench.library, options)
    head_ratio = model_profile(calibration, context=1).head_bytes / layer_weight_bytes(calibration)
    one_thread = await asyncio.to_thread(one_thread_profile, calibration, bench.calibration_steps)
    prompt = bench.prompt_ids or tuple(ChatTokenizer(checkpoint).encode_chat([{"role": "user", "content": PROMPT}]))
    groups: list[dict[str, Any]] = []
    async with fleet_host(work / "console") as host, contextlib.AsyncExitStack() as stack:
        for n in bench.agent_counts:
            print(f"  placing over {n} agent(s)", file=sys.stderr, flush=True)
            agents = await stack.enter_async_context(_agents(work, host, [f"g{n}-{i}" for i in range(n)]))
            state = work / f"console-{n}"
            state.mkdir(parents=True)
            (state / CALIBRATION_DIR).symlink_to((bench.library / CALIBRATION_DIR).resolve())
            latency, plan, profiles = await _async_place_group(state, host, agents, checkpoint, options,
                                                               calibration, bench.calibration_steps,
                                                               bench.plan_streams, bench.threads)
            by_node = {a.status().node_id: a for a in agents}
            groups.append({"n": n, "latency": latency, "plan": plan, "profiles": profiles, "agents": by_node,
                           "runs": []})
        library = ModelLibrary(bench.library)
        for g in groups:
            print(f"  exporting the {len(g['plan'].stages)}-stage plan", file=sys.stderr, flush=True)
            job = library.start_export(bench.model, plan=g["plan"], spec=spec)
            g["export"] = await asyncio.to_thread(job.wait, 3600)
        for g in groups:
            endpoints = {node: AgentEndpoint(f"127.0.0.1:{a.control_port}", free_port(), a.settings.name)
                         for node, a in g["agents"].items()}
            g["dist"] = await stack.enter_async_context(Distributor(
                host, g["export"].path, RingLayout.from_plan(g["plan"], endpoints), export_id=g["export"].export_id,
                worker=WorkerSettings(threads=bench.threads)))
            await g["dist"].async_run()
        print("  measuring", file=sys.stderr, flush=True)
        for round_ in range(bench.warmups + bench.runs):
            for g in (groups if round_ % 2 == 0 else groups[::-1]):
                pids = [g["agents"][s.pc_id].worker_pid for s in g["plan"].stages]
                run = await _timed_request(g["dist"].coordinator, prompt, bench.tokens, pids)
                await g["dist"].coordinator.async_wait_idle()
                if round_ >= bench.warmups:
                    g["runs"].append(run)
        for g in groups:
            metrics = g["dist"].coordinator.metrics()
            g["coordinator"] = {k: metrics.get(k) for k in ("ring_step_ms_avg", "coordinator_overhead_ms_per_step")}
    summaries = [_summary(g, one_thread, head_ratio) for g in groups]
    return {"model": source.name, "weights": bench.weights, "tokens": bench.tokens, "prompt_tokens": len(prompt),
            "runs": bench.runs, "warmups": bench.warmups, "worker_threads": bench.threads,
            "calibration_steps": bench.calibration_steps, "head_ratio": head_ratio,
            "one_thread_profile": list(one_thread), "groups": summaries, "stage_cpu_fit": fit_stage_cpu(summaries)}


def _summary(g: dict[str, Any], one_thread: tuple[float, float], head_ratio: float) -> dict[str, Any]:
    plan, runs = g["plan"], g["runs"]
    measured_ms = median([r["ms_per_token"] for r in runs])
    stage_cpu = [median([r["stage_cpu_ms"][k] for r in runs]) for k in range(len(plan.stages))]
    one_stages, one_ms = predict(plan, [one_thread] * len(plan.stages), head_ratio)
    return {
        "agents": g["n"], "names": {node: a.settings.name for node, a in g["agents"].items()},
        "latency_plan": _plan_dict(g["latency"]), "plan": _plan_dict(plan), "export_id": g["export"].export_id,
        "split": list(g["export"].split), "stage_profiles": [list(g["profiles"][s.pc_id]) for s in plan.stages],
        "runs_detail": runs, "measured_ms_per_token": measured_ms, "measured_tok_s": 1000 / measured_ms,
        "measured_stage_cpu_ms": stage_cpu, "measured_rest_ms": measured_ms - sum(stage_cpu),
        "error_pct": error_pct(plan.tok_s, 1000 / measured_ms),
        "one_thread": {"stage_ms": one_stages, "per_token_ms": one_ms, "tok_s": 1000 / one_ms,
                       "error_pct": error_pct(1000 / one_ms, 1000 / measured_ms)},
        "coordinator": g["coordinator"]}


def configure(p: argparse.ArgumentParser) -> None:
    from tests.benchmarks.kit import add_common_arguments

    p.add_argument("--agents", default="1,2,3", help="agent group sizes, one ring each (default 1,2,3)")
    p.add_argument("--weights", default="int4", help="weight format of every export (default int4)")
    p.add_argument("--calibration-steps", type=int, default=64,
                   help="decode steps timed per calibration stage (default 64; the console uses 16)")
    add_common_arguments(p, "placement.json", runs=5, warmups=1)


def run(args: argparse.Namespace) -> int:
    from export.sources import default_cache_root

    machine = machine_info()
    bench = PlacementBench(model=None, library=default_cache_root() / "bench-placement", weights=args.weights,
                           agent_counts=tuple(int(n) for n in args.agents.split(",")), tokens=args.tokens,
                           runs=args.runs, warmups=args.warmups, calibration_steps=args.calibration_steps)
    with tempfile.TemporaryDirectory(prefix="deskfleet-bench-placement-") as tmp:
        os.environ["DESKFLEET_KEYRING_DIR"] = str(Path(tmp) / "keyring")  # never the real keyring
        result = asyncio.run(async_run_bench(Path(tmp), bench))
    result.update({"benchmark": "placement", "command": COMMAND_LINE, "machine": machine,
                   "load_average_end": [round(x, 2) for x in os.getloadavg()]})
    write_json(args.json, result)
    update_section(args.doc, "placement", render(result, args.json))
    print(render(result, args.json))
    return 0


COMMAND = Command(name="placement", help="placement's predicted tok/s vs what the distributed ring measures",
                  configure=configure, run=run)
