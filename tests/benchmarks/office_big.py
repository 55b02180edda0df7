"""Bigger than one PC, measured: ``python -m tests.benchmarks office-big``.

A random-weight checkpoint of a real shape (SmolLM2-1.7B's layers: hidden 2048, MLP 8192, 32 heads,
vocab 49152, tied embeddings; ``--layers`` of its 24, 8 by default; the default model's tokenizer,
which is that family's) is written on disk. The emulated office's desks (tests/support/office) get
a memory limit sized to the model: ``--memory-mb`` (1400 MiB by default) holds a half of its INT4
export with its worker, but not the whole; placement may fill ``--headroom`` (0.4) of a desk's free
memory. Then, through the real fleet service and agents:

1. each agent reports its PC's memory: the cgroup limit, not the machine's RAM;
2. the service places the model (``POST /placements``: it measures, calibrates and solves) on
   2-3 desks, each stage within its desk's memory;
3. the same placement solved on one desk is refused before anything is exported, naming the memory
   the model needs and the desk's; the layouts the Placement page would offer
   (`engine.placement.layouts`) say the same: rings, no copy;
4. the service exports the model with the plan's split and serves it; people ask through the
   openai client (greedy, ``--tokens``); decode tok/s is set against the bandwidth bound: the
   weight bytes a token streams (every stage's weights, less the int8 embedding, which is
   gathered) over the bandwidth a one-thread read sweep measures inside a desk's cgroup.

The checkpoint and everything the office made are deleted afterwards (``--checkpoint`` reuses one
and keeps it). Needs root (namespaces, cgroups). The machine's load is recorded beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.cli.main import Command
from tests.benchmarks.record import DEFAULT_DOC, DEFAULT_JSON_DIR, machine_info, markdown_table, median, update_section

GIB = 1 << 30
MIB = 1 << 20
SHAPE_NAME = "SmolLM2-1.7B"
SHAPE_ARGS = {"layers": 24, "hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 32, "vocab": 49152,
              "tie_embeddings": True}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
EMBEDDING_BYTES_PER_VALUE = 1  # the INT4 preset keeps the embedding int8 (gathered a row per token, not streamed)

# One thread reads arrays of these sizes (MiB) inside the PC's cgroup; the largest, past any cache, is the figure.
SWEEP = """
import json, sys, time
import numpy as np
out = {}
for mib in (4, 32, 256):
    a = np.ones(mib * (1 << 20) // 4, dtype=np.float32)
    a.sum()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        a.sum()
        n += 1
    out[mib] = n * a.nbytes / (time.perf_counter() - t0) / 1e9
    del a
print(json.dumps(out))
"""


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--desks", type=int, default=2, help="desk PCs the model is placed on (default 2; 3 also fits)")
    p.add_argument("--cores", type=float, default=1.0, help="cores per desk (default 1)")
    p.add_argument("--memory-mb", type=int, default=1400,
                   help="memory limit per desk, sized to the model: half of it fits, all of it does not (default 1400)")
    p.add_argument("--headroom", type=float, default=0.4,
                   help="the share of a desk's free memory placement may fill with weights and KV; the rest is the "
                        "worker's own, about as much again (default 0.4)")
    p.add_argument("--layers", type=int, default=8,
                   help="decoder layers of the shape (default 8 of SmolLM2-1.7B's 24: the same layers, a smaller "
                        "model; all 24 did not answer yet, docs/BENCHMARKS.md)")
    p.add_argument("--users", default="1,2", help="concurrent users, comma-separated (default 1,2)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per answer (default 32)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every user count (default 2)")
    p.add_argument("--context", type=int, default=1024, help="context the placement reserves KV for (default 1024)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="a checkpoint of the shape written before (kept); default: write one, delete it after")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON_DIR / "office_big.json", help="raw results")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown whose office-big section is rewritten")
    p.add_argument("--no-doc", action="store_true", help="record nothing in the Markdown (a trial run)")


def command_line(args: argparse.Namespace) -> str:
    return (f"python -m tests.benchmarks office-big --layers {args.layers} --desks {args.desks} --cores "
            f"{args.cores:g} --memory-mb {args.memory_mb} --users {args.users} --tokens {args.tokens} --rounds "
            f"{args.rounds} --context {args.context} --headroom {args.headroom:g}")


def say(text: str) -> None:
    print(f"[office-big] {text}", file=sys.stderr, flush=True)


def write_checkpoint(directory: Path, layers: int = 24) -> Path:
    """The shape's random-weight checkpoint (``layers`` of its layers) with the default model's tokenizer
    (the same family's)."""
    from export.sources import resolve_model
    from tests.support.synthetic_checkpoint import LlamaShape, write_synthetic_llama

    checkpoint = write_synthetic_llama(directory, LlamaShape(**{**SHAPE_ARGS, "layers": layers}))  # type: ignore[arg-type]
    source = resolve_model(None).checkpoint_dir
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, checkpoint / name)
    return checkpoint


def streamed_bytes(export: Path) -> tuple[int, int]:
    """(weight bytes a decode token streams, all weight bytes) of an export: every stage's weights
    less the embedding (gathered, not streamed)."""
    from engine.shards.manifest import ir_paths, load_manifest

    manifest = load_manifest(export)
    total = sum(f.size for st in manifest.stages for f in st.files if f.path == ir_paths(st.xml)[1])
    embedding = SHAPE_ARGS["vocab"] * SHAPE_ARGS["hidden"] * EMBEDDING_BYTES_PER_VALUE
    return total - embedding, total


def bandwidth_bound(tok_s: float, streamed: int, gb_s: float) -> dict[str, float]:
    """The bandwidth bound of one user's decode (every stage's weights read once a token, one after
    another) and the measured rate as a fraction of it."""
    bound = gb_s * 1e9 / streamed
    return {"bound_tok_s": bound, "of_bound": tok_s / bound}


async def _sweep(pc) -> dict[str, float]:
    done = await asyncio.to_thread(pc.run, [sys.executable, "-c", SWEEP], timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"the bandwidth sweep on {pc.name} failed: {done.stderr[-2000:]}")
    return {f"{k} MiB": v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


async def _async_run(args: argparse.Namespace, root: Path, checkpoint: Path) -> dict[str, Any]:
    from console.fleet_api.admin_decode import inputs_from_json
    from engine.placement.layouts import LayoutKind, propose
    from tests.support.office.office import Office, OfficeSpec, building
    from tests.support.office.pc import PcSpec
    from tests.support.office.users import ask

    users = _ints(args.users)
    spec = OfficeSpec(desks=tuple(PcSpec(f"desk-{i + 1}", cores=args.cores, memory_mb=args.memory_mb, display=False)
                                  for i in range(args.desks)),
                      server=PcSpec("server", cores=0.5, display=False),
                      people=PcSpec("people", cores=0.5, display=False))
    out: dict[str, Any] = {}
    with building(spec, root) as pcs:
        async with Office(pcs, root) as office:
            started = time.perf_counter()
            admin = await office.async_start_fleet(exact=False)
            agents = await office.async_enrol(timeout=300)
            assert office.service is not None
            state = office.service.state
            await admin.call("POST", "/agents/refresh")
            out["reported_memory_mb"] = {n: (await office.async_agent(n))["memory_bytes"] / MIB for n in agents}
            say(f"{len(agents)} desks enrolled in {time.perf_counter() - started:.0f} s; they report "
                f"{out['reported_memory_mb']} MiB")
            out["sweep_gb_s"] = await _sweep(office.desks[0])
            say(f"one-thread read sweep on desk-1: {out['sweep_gb_s']}")

            model = await office.async_add_model(checkpoint)
            started = time.perf_counter()
            placement = await office.async_placement(model, context=args.context,
                                                     request={"objective": "throughput", "n_streams": max(users),
                                                              "headroom": args.headroom})
            out["placement_s"] = time.perf_counter() - started
            plan = placement["plan"]
            names = placement["inputs"].get("names", {})
            out["plan"] = [{"pc": names.get(s["pc_id"], s["pc_id"]), "layers": [s["first_layer"], s["last_layer"]],
                            "memory_mb": s["memory_bytes"] / MIB} for s in plan["stages"]]
            say(f"placed in {out['placement_s']:.0f} s: {out['plan']}")

            alone = [a["node_id"] for name, a in agents.items() if name != "desk-1"]
            status, body = await admin.call("POST", f"/placements/{placement['id']}/solve",
                                                   {"leave_out": alone, "request": {"headroom": args.headroom}})
            out["one_pc"] = {"status": status, "message": body.get("error", {}).get("message") if status >= 300
                             else None, "plan": body.get("plan") if status < 300 else None}
            say(f"on desk-1 alone: {status} {out['one_pc']['message']}")

            inputs = inputs_from_json(placement["inputs"])
            choice = propose(inputs.model, inputs.pcs, inputs.devices, inputs.links.links, users=max(users),
                             names=inputs.names, headroom=args.headroom)
            out["layouts"] = [{"name": a.name, "kind": str(a.kind), "tok_s_one": a.tok_s_one,
                               "tok_s_users": a.tok_s_users} for a in choice.alternatives]
            one = [pc for pc in inputs.pcs if pc.pc_id not in alone]
            out["layouts_one_pc"] = propose(inputs.model, one, inputs.devices, inputs.links.links, users=1,
                                            names=inputs.names, headroom=args.headroom).refused
            out["proposed"] = choice.chosen.name if choice.chosen is not None else None
            out["proposed_is_ring"] = choice.chosen is not None and choice.chosen.kind is LayoutKind.RINGS

            started = time.perf_counter()
            try:
                ring = await office.async_serve_plan(model, plan, placement.get("spec"))
            except Exception:
                say(f"the ring did not come up; desks' memory: {[d.group.memory_report() for d in office.desks]}")
                for d in office.desks:
                    tail = (d.root / "agent.log").read_text(errors="replace")[-3000:]
                    say(f"{d.name}'s agent log, last lines:\n{tail}")
                raise
            out["serve_s"] = time.perf_counter() - started
            made = [d for d in (state / "exports").iterdir() if (d / "manifest.json").is_file()
                    and not d.name.startswith(".")]
            export = state / "exports" / ring["export_id"] if ring.get("export_id") else max(
                made, key=lambda d: d.stat().st_mtime)
            out["streamed_bytes"], out["weight_bytes"] = streamed_bytes(export)
            say(f"serving after {out['serve_s']:.0f} s (export {export.name}, {out['weight_bytes'] / 1e6:.0f} MB)")

            url, key, ca = await office.async_api()
            await asyncio.to_thread(ask, office.people, url, key, users=1, max_tokens=4, ca_file=ca)
            rows = []
            for r in range(args.rounds):
                for n in users:
                    a = await asyncio.to_thread(ask, office.people, url, key, users=n, max_tokens=args.tokens,
                                                first_user=100 * r + 10 * n, ca_file=ca)
                    decode = [(t - 1) / max(1e-9, a.seconds - f) for t, f in zip(a.completion_tokens, a.first_token_s,
                                                                                 strict=True) if t > 1]
                    rows.append({"round": r, "users": n, "tok_s": a.tokens_per_s, "tokens": sum(a.completion_tokens),
                                 "decode_tok_s_per_user": median(decode) if decode else 0.0,
                                 "ttft_s": median(a.first_token_s)})
                    say(f"  {n} users: {a.tokens_per_s:.2f} tok/s ({sum(a.completion_tokens)} tokens)")
            out["rounds"] = rows
            out["desk_memory"] = {d.name: d.group.memory_report() for d in office.desks}
    return out


def summarise(result: dict[str, Any]) -> list[dict[str, Any]]:
    gb_s = max(result["sweep_gb_s"].values()) if result["sweep_gb_s"] else 0.0
    large = result["sweep_gb_s"].get("256 MiB", gb_s)
    rows = []
    for n in sorted({r["users"] for r in result["rounds"]}):
        mine = [r for r in result["rounds"] if r["users"] == n]
        tok_s = median([r["tok_s"] for r in mine])
        per_user = median([r["decode_tok_s_per_user"] for r in mine])
        rows.append({"users": n, "tok_s": tok_s, "decode_tok_s_per_user": per_user, "rounds": len(mine),
                     **bandwidth_bound(per_user, result["streamed_bytes"], large)})
    return rows


def render(result: dict[str, Any], command: str) -> str:
    s, m = result["settings"], result["machine"]
    lines = [f"## Bigger than one PC: a {SHAPE_NAME}-shaped model on {s['desks']} emulated PCs (office-big)", "",
             f"    {command}", "",
             f"A random-weight checkpoint of {SHAPE_NAME}'s shape ({s.get('layers', 24)} of its 24 layers, "
             f"hidden 2048, vocab 49152), INT4: "
             f"{result['weight_bytes'] / 1e6:.0f} MB of weights. The desks' memory limit ({s['memory_mb']} MiB each, "
             f"{s['cores']:g} core each) is sized to the model: a half fits with its worker, the whole does not; "
             f"placement fills at most {s.get('headroom', 0.8):.0%} of a desk's free memory (the rest is the worker's "
             "own). "
             f"Agents report {', '.join(f'{v:.0f}' for v in result['reported_memory_mb'].values())} MiB (their "
             f"cgroup's limit). The fleet service placed it (measured, calibrated, solved) as "
             + "; ".join(f"{p['pc']} layers {p['layers'][0]}-{p['layers'][1]} ({p['memory_mb']:.0f} MiB)"
                         for p in result["plan"]) + ".", "",
             f"On one desk: refused before loading, HTTP {result['one_pc']['status']}: "
             f"\"{result['one_pc']['message']}\". The Placement page's layouts on one desk: "
             f"\"{result['layouts_one_pc']}\"; over all desks it proposes {result['proposed']}.", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, **loaded: load average {m['load_average']} at the start, "
             f"{result['load_after']} at the end** (other work was running). These are not quiet-machine figures.",
             ""]
    rows = [[x["users"], f"{x['tok_s']:.2f}", f"{x['decode_tok_s_per_user']:.2f}", f"{x['bound_tok_s']:.1f}",
             f"{x['of_bound']:.2f}", x["rounds"]] for x in result["summary"]]
    lines.append(markdown_table(["users", "tok/s (all)", "decode tok/s per user", "bandwidth bound tok/s",
                                 "of bound", "rounds"], rows))
    sweep = ", ".join(f"{k}: {v:.1f} GB/s" for k, v in result["sweep_gb_s"].items())
    lines += ["", f"Bandwidth bound: {result['streamed_bytes'] / 1e6:.0f} MB streamed per token (every stage's "
              f"weights less the int8 embedding) over one thread's read rate in desk-1's cgroup ({sweep}; the "
              "largest array's figure). Peak memory per desk: " + ", ".join(
                  f"{k} {v['max_usage_bytes'] / MIB:.0f} MiB of {v['limit_bytes'] / MIB:.0f}, OOM kills "
                  f"{v['oom_kills']}" for k, v in result["desk_memory"].items()) + "."]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    import os

    from tests.support.office.office import why_unavailable

    reason = why_unavailable()
    if reason is not None:
        print(f"office-big benchmark: cannot build an office here: {reason}", file=sys.stderr)
        return 2
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="bench-office-big-") as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            started = time.perf_counter()
            checkpoint = write_checkpoint(Path(tmp) / "checkpoint", args.layers)
            say(f"checkpoint written in {time.perf_counter() - started:.0f} s")
        result = asyncio.run(_async_run(args, Path(tmp) / "office", checkpoint))
    result |= {"machine": machine, "load_after": [round(x, 2) for x in os.getloadavg()],
               "settings": {k: getattr(args, k) for k in ("desks", "cores", "memory_mb", "users", "tokens",
                                                          "rounds", "context", "headroom", "layers")}}
    result["summary"] = summarise(result)
    text = render(result, command_line(args))
    print(text)
    from tests.benchmarks.record import write_json

    write_json(args.json, result)
    if not args.no_doc:
        update_section(args.doc, "office-big", text)
    return 0


COMMAND = Command(name="office-big", help="a model bigger than one emulated PC's memory placed on 2-3 of them by the "
                                          "fleet service; refused on one; decode tok/s against the bandwidth bound",
                  configure=configure, run=run)
