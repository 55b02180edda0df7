"""``python -m tests.benchmarks failover``: how long a user waits when a PC of the ring is lost
mid-answer, and where the time goes.

The default model as 2 INT4 stages on two real agents (desk-a stage 0, desk-b stage 1), a third
agent as standby, the console's Distributor on the paged runtime (the console's default) with
its failover, mutual TLS on loopback. Every agent keeps a warm spare (``--warm-spare``, default
on: a second worker process with the stage compiled; the standby's is of the last stage). One
conversation of 512 tokens (a chat prompt of ~300 tokens, generation to 512 in total, EOS
ignored); half-way through the answer the last stage's worker is SIGKILLed. Two recoveries,
interleaved round by round, each started once every spare is compiled:

- restart: the agent's supervisor replaces the worker on the same address (its spare promoted,
  or with ``--warm-spare off`` a new worker started and compiled); the console waits for it
  (``restart_grace_s`` long) and replays;
- standby: the PC's compute is lost (the worker and its spare are SIGKILLed), the console moves
  the stage to the standby at once (``restart_grace_s`` = 0; the standby's spare is promoted),
  re-points the upstream agent and replays. The agent that lost the stage becomes the standby,
  so rounds alternate between the two.

Added delay = the largest inter-token gap from the kill on, minus the median inter-token gap of
the same run. Its breakdown: *notice* (kill to the coordinator holding its streams: the agent's
worker-lost event, else the ring watch), *bring-up* (to every stage reporting serving: for a
new worker, spawn and imports, then conversion and compile, from the worker's own timing line;
for a spare only its activation), *redial* (the console's path up again) and *replay* (to the
next token: the held conversation re-prefilled through the paged scheduler's chunks of
``token_budget`` tokens, whose last row predicts the next token). Every disturbed answer must be
identical to the undisturbed one.

Per step of the replay (the coordinator's step log): when it was sent and answered after the
redial, its tokens and each stage's compute time. ``--pipeline both`` interleaves runs with the
scheduler's prefill pipelining (a chunk may follow the one in flight, so the stages overlap) on
and off, to measure what it changes in one sitting.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.cli.main import Command
from tests.benchmarks.record import machine_info, markdown_table, median, update_section, write_json
from tests.support.loopback import free_port

COMMAND_LINE = "python -m tests.benchmarks failover"
TARGET_S = 3.0  # issue 15, Deliver 4: < 3 s added for both recoveries
TOTAL_TOKENS = 512
MODES = ("restart", "standby")

# A support conversation of ~300 tokens with the default model's template.
_TURNS = (
    ("user", "Our office has twelve desktop PCs that sit idle most evenings. We want to run a small "
             "language model across them so that staff can ask questions about internal documents. "
             "What should we think about before we start?"),
    ("assistant", "Start with the network: the PCs exchange hidden states for every generated token, so "
                  "a wired gigabit link between them matters more than their CPUs. Then memory: each PC "
                  "holds a slice of the model's layers and the cache of every active conversation. "
                  "Finally, people: a PC that someone starts using again must hand its work back at once."),
    ("user", "What happens when someone closes their laptop or pulls the plug while the model is in the "
             "middle of an answer? Do we lose the answer, and does the person asking have to start over?"),
    ("assistant", "The coordinator notices that a stage stopped answering, holds the conversation, and "
                  "either waits for the PC to come back or moves its slice of the model to a standby PC. "
                  "It then replays the conversation so far on the repaired ring and continues where it "
                  "stopped, so the person sees a pause rather than an error."),
    ("user", "Explain in detail how the replay works, why the continued answer is the same as it would "
             "have been, and how long the pause is likely to be on ordinary office hardware."),
)


def configure(p: argparse.ArgumentParser) -> None:
    from tests.benchmarks.record import DEFAULT_DOC, DEFAULT_JSON_DIR

    p.add_argument("--rounds", type=int, default=3, help="rounds of each recovery, interleaved (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=400,
                   help="most prompt tokens: whole turns that fit (default 400)")
    p.add_argument("--step-timeout", type=float, default=10.0, help="the coordinator's step timeout (default 10)")
    p.add_argument("--exact", action="store_true", help="workers in exact (f32) mode instead of the shard's own")
    p.add_argument("--warm-spare", choices=("on", "off"), default="on",
                   help="the agents keep a warm spare (default on; off measures the cold path)")
    p.add_argument("--pipeline", choices=("on", "off", "both"), default="on",
                   help="the scheduler's prefill pipelining (default on; both: interleaved on/off runs)")
    p.add_argument("--modes", default=",".join(MODES), help=f"recoveries to run, comma-separated (default "
                   f"{','.join(MODES)})")
    p.add_argument("--total-tokens", type=int, default=TOTAL_TOKENS,
                   help=f"prompt + generated tokens per answer (default {TOTAL_TOKENS}; smaller for a smoke run)")
    p.add_argument("--export", type=Path, default=None,
                   help="a 2-stage export to use instead of the default model's INT4 one (a smoke run)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "failover.json", help="where the raw results go")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown file whose section is rewritten")


def conversation(tokenizer, target: int) -> list[int]:
    """The chat prompt: whole turns while they fit in ``target`` tokens (at least two)."""
    turns = [{"role": r, "content": c} for r, c in _TURNS]
    for n in range(len(turns), 1, -1):
        if n % 2 == 1:  # end on a user turn
            ids = tokenizer.encode_chat(turns[:n])
            if len(ids) <= target:
                return ids
    return tokenizer.encode_chat(turns[:1])[:target]


def added_delay(times: list[float], kill_index: int) -> tuple[float, float, float]:
    """(added delay, largest gap from the kill on, median gap) of token arrival ``times``."""
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    typical = median(gaps)
    worst = max(gaps[max(0, kill_index - 1):])
    return worst - typical, worst, typical


async def _async_timed(dist, prompt: list[int], n: int, kill=None) -> dict[str, Any]:
    """One answer's tokens and their arrival (monotonic) times; ``kill()`` half-way through."""
    from engine.generation.request import GenerationRequest

    tokens, times = [], []
    kill_index = n // 2
    killed = {}
    started = time.monotonic()
    async for event in dist.coordinator.stream(GenerationRequest(tuple(prompt), n, ignore_eos=True)):
        tokens.append(event.token_id)
        times.append(time.monotonic())
        if kill is not None and len(tokens) == kill_index:
            killed = {"kill_mono": time.monotonic(), "kill_wall": time.time()}
            kill()
    return {"tokens": tokens, "times": times, "kill_index": kill_index, "ttft_s": times[0] - started, **killed}


def breakdown(run: dict[str, Any], recovery: dict[str, Any] | None, start: dict[str, Any] | None) -> dict[str, Any]:
    """Where the added delay went (seconds; None when not seen). ``recovery``: the RingRecovery
    timeline entry (monotonic), ``start``: how the worker now serving the lost stage came up
    (the supervisor's record, wall clock)."""
    out: dict[str, Any] = {"notice_s": None, "bring_up_s": None, "redial_s": None, "replay_s": None,
                           "spare_promoted": None, "spawn_imports_s": None, "compile_s": None, "activate_s": None}
    if recovery is None or "kill_mono" not in run:
        return out
    kill = run["kill_mono"]
    out["notice_s"] = recovery["started"] - kill
    if "serving" in recovery:
        out["bring_up_s"] = recovery["serving"] - recovery["started"]
    if "redialled" in recovery:
        out["redial_s"] = recovery["redialled"] - recovery.get("serving", recovery["started"])
        after = [t for t in run["times"] if t > recovery["redialled"]]
        out["replay_s"] = after[0] - recovery["redialled"] if after else None
    if start is not None:
        out["spare_promoted"] = bool(start.get("promoted"))
        if start.get("promoted"):
            out["activate_s"] = start.get("listening", start["ready"]) - start.get("activated", start["ready"])
        elif "entered" in start and "opened" in start:
            out["spawn_imports_s"] = start["entered"] - start["spawned"]
            out["compile_s"] = start["opened"] - start["entered"]
    return out


def replay_steps(steps, recovery: dict[str, Any] | None, run: dict[str, Any]) -> list[dict[str, Any]]:
    """The steps of the replay: sent from the redial on and answered by the next token (times in s
    from the redial); ``steps`` are the coordinator's StepTiming records."""
    if recovery is None or "redialled" not in recovery:
        return []
    start = recovery["redialled"]
    after = [t for t in run["times"] if t > start]
    if not after:
        return []
    return [{"tokens": st.tokens, "answered_rows": st.answered, "sent_s": st.sent_at - start,
             "answered_s": st.answered_at - start, "round_trip_ms": 1000 * (st.answered_at - st.sent_at),
             "stage_ms": list(st.stage_ms), "failed": st.failed}
            for st in steps if st.sent_at >= start and st.answered_at <= after[0]]


async def _async_spares_ready(dist, agents: dict, timeout: float = 600.0) -> bool:
    """Wait until every ring member and every standby the ring counts on holds a compiled spare."""
    by_control = {f"127.0.0.1:{a.control_port}": a for a in agents.values()}
    wanted = [by_control[t.control] for t in dist.layout.targets] + [by_control[c] for c in dist.recovery.spares]
    deadline = time.monotonic() + timeout
    while not all(a.spare_ready for a in wanted):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.2)
    return True


@contextlib.asynccontextmanager
async def _agents(work: Path, con, names: tuple[str, ...], warm_spare: str):
    from agent.service.idle import FakeIdle
    from agent.service.service import AgentService
    from agent.service.settings import AgentSettings

    agents = {}
    try:
        for name in names:
            settings = AgentSettings(name=name, interface="127.0.0.1", control_port=0, data_port=0,
                                     warm_spare=warm_spare)
            agents[name] = AgentService(work / name, settings, idle_source=FakeIdle(1e6), power=lambda: None)
            await agents[name].async_start()
            await agents[name].async_join(con.enrollment, con.token())
        yield agents
    finally:
        for agent in agents.values():
            await agent.async_close()


async def _async_one(dist, agents: dict, settings, prompt: list[int], n: int, reference: dict[str, Any], mode: str,
                     pipelined: bool, spares: bool) -> dict[str, Any]:
    """One disturbed answer: kill the last stage's worker half-way (standby: its spare too)."""
    spares_ready = await _async_spares_ready(dist, agents) if spares else False
    dist.failover = replace(settings, restart_grace_s=0.0 if mode == "standby" else 120.0)
    scheduler = dist.coordinator.scheduler
    scheduler.config = replace(scheduler.config, pipeline_prefill=pipelined)
    last = dist.layout.targets[-1]
    victim = agents[last.label]
    pids = [victim.worker_pid] + ([victim.spare_pid] if mode == "standby" and victim.spare_pid else [])
    moves_before = len(dist.recovery.moves)
    recoveries_before = len(dist.recovery.timeline)

    def kill() -> None:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    run = await _async_timed(dist, prompt, n, kill=kill)
    delay, worst, typical = added_delay(run["times"], run["kill_index"])
    moved = dist.recovery.moves[moves_before:]
    serving = agents[dist.layout.targets[-1].label]
    recovery = dist.recovery.timeline[recoveries_before] if len(dist.recovery.timeline) > recoveries_before else None
    starts = [s for s in serving.worker_starts if s.get("ready", 0) >= run.get("kill_wall", 0)]
    parts = breakdown(run, recovery, starts[0] if starts else None)
    replayed = len(prompt) + run["kill_index"]  # the conversation so far, re-prefilled
    parts["replay_tokens"] = replayed
    parts["replay_tok_s"] = replayed / parts["replay_s"] if parts["replay_s"] else None
    return {"mode": mode, "pipeline": pipelined, "killed": last.label, "killed_pids": pids,
            "spares_ready": spares_ready, "serving_after": dist.layout.targets[-1].label,
            "serving_pid": serving.worker_pid, "added_delay_s": delay, "largest_gap_s": worst, "median_gap_s": typical,
            "move_s": moved[0].seconds if moved else None, **parts,
            "replay_steps": replay_steps(dist.coordinator.step_log, recovery, run),
            "failover_reason": recovery["reason"] if recovery else None,
            "identical": run["tokens"] == reference["tokens"],
            "first_difference": next((i for i, (a, b) in enumerate(zip(run["tokens"], reference["tokens"],
                                                                        strict=False)) if a != b), None),
            "failovers_total": dist.coordinator.metrics()["failovers_total"]}


async def _async_bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from console.fleet.distribution import Distributor
    from console.fleet.failover import FailoverSettings
    from console.fleet.ring_layout import AgentEndpoint, AgentTarget, RingLayout
    from engine.control.fleet_services import fleet_host
    from engine.control.messages import WorkerSettings
    from engine.generation.tokenizer import ChatTokenizer
    from tests.benchmarks.kit import default_model_exports

    if args.export is not None:
        export = args.export
    else:
        _, (export,), _ = default_model_exports(("int4", 2, True))
    prompt = conversation(ChatTokenizer(export / "tokenizer"), args.prompt_tokens)
    n = args.total_tokens - len(prompt)
    settings = FailoverSettings(step_timeout_s=args.step_timeout, hold_s=120.0, restart_grace_s=120.0)
    runs: list[dict[str, Any]] = []
    names = ("desk-a", "desk-b", "desk-c")
    async with fleet_host(work / "console") as con, _agents(work, con, names, args.warm_spare) as agents:
        control = {name: f"127.0.0.1:{a.control_port}" for name, a in agents.items()}
        layout = RingLayout.of([AgentTarget(control["desk-a"], 0, free_port(), "desk-a"),
                                AgentTarget(control["desk-b"], 1, free_port(), "desk-b")])
        standby = [AgentEndpoint(control["desk-c"], free_port(), "desk-c")]
        worker = WorkerSettings(threads=1, exact=args.exact)
        async with Distributor(con, export, layout, worker=worker, standby=standby, failover=settings,
                               runtime="paged") as dist:
            await dist.async_run()
            spares = args.warm_spare == "on"
            if spares:
                await _async_spares_ready(dist, agents)
            reference = await _async_timed(dist, prompt, n)
            variants = {"on": (True,), "off": (False,), "both": (True, False)}[args.pipeline]
            for round_index in range(args.rounds):
                for mode in [m for m in MODES if m in args.modes.split(",")]:
                    # alternate which goes first: the second run of a round kills a worker that was itself a spare
                    for pipelined in variants if round_index % 2 == 0 else variants[::-1]:
                        runs.append(await _async_one(dist, agents, settings, prompt, n, reference, mode, pipelined,
                                                     spares))
                        runs[-1]["round"] = round_index
                        r = runs[-1]
                        print(f"  round {round_index + 1} {_label(r)}: added {r['added_delay_s']:.2f} s (gap "
                              f"{r['largest_gap_s']:.2f} s, median {r['median_gap_s'] * 1000:.0f} ms; "
                              f"{_parts_text(r)}; steps {_steps_text(r)}), identical={r['identical']}", flush=True)
                        await asyncio.sleep(1.0)
            health = await dist.async_health()
    _, ref_worst, ref_typical = added_delay(reference["times"], 1)
    return {"prompt_tokens": len(prompt), "new_tokens": n, "exact": args.exact, "step_timeout_s": args.step_timeout,
            "watch_s": settings.watch_s, "warm_spare": args.warm_spare, "runtime": "paged", "pipeline": args.pipeline,
            "token_budget": dist.runtime.token_budget, "export": export.name,
            "reference_median_gap_s": ref_typical, "reference_largest_gap_s": ref_worst,
            "first_request_ttft_s": reference["ttft_s"],  # the fresh ring's first request (cold kernels)
            "runs": runs, "healthy_at_end": health.ok}


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _parts_text(r: dict[str, Any]) -> str:
    bring = (f"spare activated in {_seconds(r['activate_s'])} s" if r["spare_promoted"] else
             f"spawn+imports {_seconds(r['spawn_imports_s'])} s, compile {_seconds(r['compile_s'])} s")
    return (f"notice {_seconds(r['notice_s'])} s, bring-up {_seconds(r['bring_up_s'])} s ({bring}), "
            f"redial {_seconds(r['redial_s'])} s, replay {_seconds(r['replay_s'])} s")


def _machine(m: dict[str, Any]) -> str:
    load = ", ".join(str(x) for x in m.get("load_average", ()))
    return f"{m.get('cores')} cores, OpenVINO {m.get('openvino')}, load average at start {load}, {m.get('date')}"


def _median_of(runs: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in runs if r.get(key) is not None]
    return f"{median(values):.2f} s" if values else "-"


def _rate(runs: list[dict[str, Any]]) -> str:
    values = [r["replay_tok_s"] for r in runs if r.get("replay_tok_s")]
    return f"{median(values):.0f}" if values else "-"


def _label(r: dict[str, Any]) -> str:
    return r["mode"] if r.get("pipeline", True) else f"{r['mode']}, no pipelining"


def _steps_text(r: dict[str, Any]) -> str:
    """``256+149 tok: 0.01-0.95 [470/455 ms], ...``: each replay step's tokens, send and answer
    times after the redial and stage compute ms."""
    steps = r.get("replay_steps") or []
    if not steps:
        return "-"
    each = ", ".join(f"{st['tokens']} tok {st['sent_s']:.2f}-{st['answered_s']:.2f} s "
                     f"[{'/'.join(f'{ms:.0f}' for ms in st['stage_ms'])} ms]" for st in steps)
    return f"{'+'.join(str(st['tokens']) for st in steps)}: {each}"


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    timed = sorted((r for r in runs if r.get("replay_s") is not None), key=lambda r: r["replay_s"])
    return timed[(len(timed) - 1) // 2] if timed else runs[0]


def render(result: dict[str, Any], json_path: Path) -> str:
    rows, parts, verdicts, steps = [], [], [], []
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(result["runs"], key=lambda r: (MODES.index(r["mode"]), not r.get("pipeline", True))):
        groups.setdefault(_label(r), []).append(r)
    for mode, runs in groups.items():
        delays = [r["added_delay_s"] for r in runs]
        identical = sum(r["identical"] for r in runs)
        moves = [r["move_s"] for r in runs if r["move_s"] is not None]
        ok = median(delays) < TARGET_S
        rows.append([mode, ", ".join(f"{d:.1f}" for d in delays), f"{median(delays):.2f} s", f"{max(delays):.2f} s",
                     f"{median([r['median_gap_s'] for r in runs]) * 1000:.0f} ms",
                     f"{median(moves):.2f} s" if moves else "-", f"{identical}/{len(runs)}",
                     f"< {TARGET_S:.0f} s", "met" if ok else "**missed**"])
        promoted = sum(bool(r.get("spare_promoted")) for r in runs)
        parts.append([mode, _median_of(runs, "notice_s"), _median_of(runs, "bring_up_s"),
                      _median_of(runs, "spawn_imports_s"), _median_of(runs, "compile_s"),
                      _median_of(runs, "activate_s"), _median_of(runs, "redial_s"), _median_of(runs, "replay_s"),
                      _rate(runs), f"{promoted}/{len(runs)}"])
        if any(r.get("replay_steps") for r in runs):
            typical = _median_run(runs)
            steps.append([mode, f"{_seconds(typical.get('replay_s'))} s", _steps_text(typical)])
        if identical < len(runs):
            verdicts.append(f"- {mode}: {len(runs) - identical} answer(s) differ from the undisturbed run: "
                            "**missed**")
    spare = ("on (each agent keeps its stage compiled in a second process; the standby, the last stage)"
             if result.get("warm_spare", "on") == "on" else "off")
    return "\n".join([
        "## Failover: a PC lost mid-answer",
        "",
        f"`{result.get('command', COMMAND_LINE)}` → `{json_path.as_posix()}` ({_machine(result['machine'])}). "
        "Default model, 2 INT4 "
        f"stages on two agents (one inference thread each) and a standby agent, real TLS on loopback, the paged "
        f"runtime (token budget {result.get('token_budget', '-')}); warm spares "
        f"{spare}; a "
        f"{result['prompt_tokens']}-token chat prompt and {result['new_tokens']} greedy tokens (EOS "
        f"ignored); the last stage's worker is SIGKILLed half-way through the answer (standby: its spare too). "
        f"Rounds interleaved, each once every spare is compiled, medians. Workers "
        f"{'exact (f32)' if result['exact'] else 'in the shard’s own precision'}; step timeout "
        f"{result['step_timeout_s']:.0f} s, ring watch every {result['watch_s']:.0f} s.",
        "",
        markdown_table(["recovery", "each round (s)", "added delay (median)", "added delay (max)", "median token gap",
                        "move (median)", "answer identical", "target", "verdict"], rows),
        *([""] + verdicts if verdicts else []),
        "",
        "Where the time went (medians):",
        "",
        markdown_table(["recovery", "notice", "bring-up", "spawn + imports", "conversion + compile",
                        "spare activation", "redial", "replay", "replay tok/s", "spare used"], parts),
        *(["", "The replay's steps in the run of median replay (seconds after the redial, sent-answered; each "
           "stage's compute ms):", "", markdown_table(["recovery", "replay", "steps"], steps)] if steps else []),
        "",
        "Reading these numbers: *added delay* is the longest wait between two tokens from the kill on, "
        "minus the run's median inter-token gap: what the person asking notices. *notice* is the kill to the "
        "coordinator holding its streams (the agent reports its lost worker to the console's hub at once; "
        "the ring watch, every second, and the step timeout are the fallbacks); *bring-up* to every stage "
        "reporting serving again: a new worker's spawn and imports and its conversion and compile (from the "
        "worker's own timing line; `-` when a spare was promoted, which did both ahead of time and only binds "
        "its address and dials its next hop), or in a move the standby taking the stage and the upstream agent "
        "re-pointed; *redial* the console's path up again; *replay* to the next token: the conversation so far "
        f"(~{result['prompt_tokens'] + result['new_tokens'] // 2} tokens) re-prefilled in the paged "
        "scheduler's chunks, the last one's final row predicting the next token (*replay tok/s*: this ring's "
        "prefill speed at one inference thread per stage; with pipelining a chunk follows the one in flight, so "
        "the first stage computes chunk 2 while the second computes chunk 1; a promoted spare's block pool is "
        "mapped at its first step and its pages committed 3 s later, not written in that step). *move* is the "
        "console's time from deciding to move to every "
        "worker running. An undisturbed run's "
        f"median gap is {result['reference_median_gap_s'] * 1000:.0f} ms; the ring was "
        f"{'healthy' if result['healthy_at_end'] else '**not healthy**'} after the last round. All agents "
        "share this machine's cores: a spare compiling behind a promotion competes with the replay here, "
        "not on separate PCs (a new spare starts 3 s after its worker is up).",
    ])


def command_line(args: argparse.Namespace) -> str:
    """The command as run: the options that differ from their defaults (``--json``/``--doc`` aside)."""
    defaults = {"rounds": 3, "prompt_tokens": 400, "step_timeout": 10.0, "exact": False, "warm_spare": "on",
                "pipeline": "on", "modes": ",".join(MODES), "total_tokens": TOTAL_TOKENS, "export": None}
    parts = [COMMAND_LINE]
    for name, default in defaults.items():
        value = getattr(args, name)
        if value != default:
            flag = "--" + name.replace("_", "-")
            parts.append(flag if value is True else f"{flag} {value}")
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="deskfleet-bench-failover-") as tmp:
        work = Path(tmp)
        os.environ["DESKFLEET_KEYRING_DIR"] = str(work / "keyring")  # never the real keyring
        machine = machine_info()
        result = asyncio.run(_async_bench(args, work))
    result = {"benchmark": "failover", "command": command_line(args), "machine": machine, **result}
    write_json(args.json, result)
    update_section(args.doc, "failover", render(result, args.json))
    print(render(result, args.json))
    return 0


COMMAND = Command(name="failover", help="added delay when a ring's PC is lost mid-answer: restart vs standby",
                  configure=configure, run=run)
