"""``python -m tests.benchmarks failover``: how long a user waits when a PC of the ring is lost
mid-answer.

The default model as 2 INT4 stages on two real agents (desk-a stage 0, desk-b stage 1), a third
agent as standby, the console's Distributor with its failover, mutual TLS on loopback. One
conversation of 512 tokens (a chat prompt of ~300 tokens, generation to 512 in total, EOS
ignored); half-way through the answer the last stage's worker is SIGKILLed. Two recoveries,
interleaved round by round:

- restart: the agent's supervisor restarts the worker on the same address; the console waits
  for it (``restart_grace_s`` long) and replays;
- standby: the console moves the stage to the standby agent at once (``restart_grace_s`` = 0),
  re-points the upstream agent and replays. The agent that lost the stage becomes the standby,
  so rounds alternate between the two.

Added delay = the largest inter-token gap from the kill on, minus the median inter-token gap of
the same run. Every disturbed answer must be identical to the undisturbed one.
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
TARGET_S = 10.0
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
    from engine.generation.request import GenerationRequest

    tokens, times = [], []
    kill_index = n // 2
    async for event in dist.coordinator.stream(GenerationRequest(tuple(prompt), n, ignore_eos=True)):
        tokens.append(event.token_id)
        times.append(time.perf_counter())
        if kill is not None and len(tokens) == kill_index:
            kill()
    return {"tokens": tokens, "times": times, "kill_index": kill_index}


@contextlib.asynccontextmanager
async def _agents(work: Path, con, names: tuple[str, ...]):
    from agent.service.idle import FakeIdle
    from agent.service.service import AgentService
    from agent.service.settings import AgentSettings

    agents = {}
    try:
        for name in names:
            settings = AgentSettings(name=name, interface="127.0.0.1", control_port=0, data_port=0)
            agents[name] = AgentService(work / name, settings, idle_source=FakeIdle(1e6), power=lambda: None)
            await agents[name].async_start()
            await agents[name].async_join(con.enrollment, con.token())
        yield agents
    finally:
        for agent in agents.values():
            await agent.async_close()


async def _async_bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from console.service.distribution import Distributor
    from console.service.failover import FailoverSettings
    from console.service.ring_layout import AgentEndpoint, AgentTarget, RingLayout
    from engine.control.fleet_services import fleet_host
    from engine.control.messages import WorkerSettings
    from engine.generation.tokenizer import ChatTokenizer
    from tests.benchmarks.kit import default_model_exports

    _, (export,), _ = default_model_exports(("int4", 2, True))
    prompt = conversation(ChatTokenizer(export / "tokenizer"), args.prompt_tokens)
    n = TOTAL_TOKENS - len(prompt)
    settings = FailoverSettings(step_timeout_s=args.step_timeout, hold_s=120.0, restart_grace_s=120.0)
    runs: list[dict[str, Any]] = []
    async with fleet_host(work / "console") as con, _agents(work, con, ("desk-a", "desk-b", "desk-c")) as agents:
        control = {name: f"127.0.0.1:{a.control_port}" for name, a in agents.items()}
        layout = RingLayout.of([AgentTarget(control["desk-a"], 0, free_port(), "desk-a"),
                                AgentTarget(control["desk-b"], 1, free_port(), "desk-b")])
        standby = [AgentEndpoint(control["desk-c"], free_port(), "desk-c")]
        worker = WorkerSettings(threads=1, exact=args.exact)
        async with Distributor(con, export, layout, worker=worker, standby=standby, failover=settings) as dist:
            await dist.async_run()
            reference = await _async_timed(dist, prompt, n)
            for round_index in range(args.rounds):
                for mode in MODES:
                    dist.failover = replace(settings, restart_grace_s=0.0 if mode == "standby" else 120.0)
                    last = dist.layout.targets[-1]
                    victim = agents[last.label]
                    pid = victim.worker_pid
                    moves_before = len(dist.recovery.moves)
                    run = await _async_timed(dist, prompt, n, kill=lambda pid=pid: os.kill(pid, signal.SIGKILL))
                    delay, worst, typical = added_delay(run["times"], run["kill_index"])
                    moved = dist.recovery.moves[moves_before:]
                    runs.append({"round": round_index, "mode": mode, "killed": last.label, "killed_pid": pid,
                                 "serving_after": dist.layout.targets[-1].label, "added_delay_s": delay,
                                 "largest_gap_s": worst, "median_gap_s": typical,
                                 "move_s": moved[0].seconds if moved else None,
                                 "identical": run["tokens"] == reference["tokens"],
                                 "first_difference": next((i for i, (a, b) in enumerate(
                                     zip(run["tokens"], reference["tokens"], strict=False)) if a != b), None),
                                 "failovers_total": dist.coordinator.metrics()["failovers_total"]})
                    print(f"  round {round_index + 1} {mode}: added {delay:.2f} s (gap {worst:.2f} s, median "
                          f"{typical * 1000:.0f} ms), identical={runs[-1]['identical']}", flush=True)
                    await asyncio.sleep(1.0)
            health = await dist.async_health()
    _, ref_worst, ref_typical = added_delay(reference["times"], 1)
    return {"prompt_tokens": len(prompt), "new_tokens": n, "exact": args.exact, "step_timeout_s": args.step_timeout,
            "watch_s": settings.watch_s, "reference_median_gap_s": ref_typical, "reference_largest_gap_s": ref_worst,
            "runs": runs, "healthy_at_end": health.ok}


def _machine(m: dict[str, Any]) -> str:
    load = ", ".join(str(x) for x in m.get("load_average", ()))
    return f"{m.get('cores')} cores, OpenVINO {m.get('openvino')}, load average at start {load}, {m.get('date')}"


def render(result: dict[str, Any], json_path: Path) -> str:
    rows, verdicts = [], []
    for mode in MODES:
        runs = [r for r in result["runs"] if r["mode"] == mode]
        if not runs:
            continue
        delays = [r["added_delay_s"] for r in runs]
        identical = sum(r["identical"] for r in runs)
        moves = [r["move_s"] for r in runs if r["move_s"] is not None]
        ok = median(delays) < TARGET_S
        rows.append([mode, ", ".join(f"{d:.1f}" for d in delays), f"{median(delays):.2f} s", f"{max(delays):.2f} s",
                     f"{median([r['median_gap_s'] for r in runs]) * 1000:.0f} ms",
                     f"{median(moves):.2f} s" if moves else "-", f"{identical}/{len(runs)}",
                     f"< {TARGET_S:.0f} s", "met" if ok else "**missed**"])
        if identical < len(runs):
            verdicts.append(f"- {mode}: {len(runs) - identical} answer(s) differ from the undisturbed run: "
                            "**missed**")
    return "\n".join([
        "## Failover: a PC lost mid-answer",
        "",
        f"`{COMMAND_LINE}` → `{json_path.as_posix()}` ({_machine(result['machine'])}). Default model, 2 INT4 "
        f"stages on two agents (one inference thread each) and a standby agent, real TLS on loopback; a "
        f"{result['prompt_tokens']}-token chat prompt and {result['new_tokens']} greedy tokens (512 in all, EOS "
        f"ignored); the last stage's worker is SIGKILLed half-way through the answer. Rounds interleaved, "
        f"medians. Workers {'exact (f32)' if result['exact'] else 'in the shard’s own precision'}; step timeout "
        f"{result['step_timeout_s']:.0f} s, ring watch every {result['watch_s']:.0f} s.",
        "",
        markdown_table(["recovery", "each round (s)", "added delay (median)", "added delay (max)", "median token gap",
                        "move (median)", "answer identical", "target", "verdict"], rows),
        *([""] + verdicts if verdicts else []),
        "",
        "Reading these numbers: *added delay* is the longest wait between two tokens from the kill on, "
        "minus the run's median inter-token gap: what the person asking notices. It contains noticing "
        "the loss (the console's ring watch sees the worker gone or restarted within about a second; the "
        "step timeout is the fallback), bringing a worker up (restart: the agent's supervisor backs off "
        "1 s, then loads and compiles the shard; standby: the standby loads its shard and the upstream "
        "agent's worker restarts with its new next hop, in parallel) and the replay, a prefill of the "
        f"whole conversation so far (~{result['prompt_tokens'] + result['new_tokens'] // 2} tokens) on the "
        "repaired ring. *move* is the console's time from deciding to move to every worker running; the "
        "first move to the standby includes fetching its shard, later ones find it verified, and agents "
        "keep compiled shards, so a worker's second start is faster than its first. An undisturbed run's "
        f"median gap is {result['reference_median_gap_s'] * 1000:.0f} ms; the ring was "
        f"{'healthy' if result['healthy_at_end'] else '**not healthy**'} after the last round.",
    ])


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="deskfleet-bench-failover-") as tmp:
        work = Path(tmp)
        os.environ["DESKFLEET_KEYRING_DIR"] = str(work / "keyring")  # never the real keyring
        machine = machine_info()
        result = asyncio.run(_async_bench(args, work))
    result = {"benchmark": "failover", "command": COMMAND_LINE, "machine": machine, **result}
    write_json(args.json, result)
    update_section(args.doc, "failover", render(result, args.json))
    print(render(result, args.json))
    return 0


COMMAND = Command(name="failover", help="added delay when a ring's PC is lost mid-answer: restart vs standby",
                  configure=configure, run=run)
