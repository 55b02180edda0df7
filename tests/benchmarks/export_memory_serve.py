"""The serving step of ``python -m tests.benchmarks export-memory``: an export's stages as
loopback worker processes against the same stages chained in one process (token ids must agree),
and the decode speed as a fraction of the bandwidth bound (all stages' weight bytes per token /
the bytes per second of a one-thread sweep). Each step runs in its own interpreter, so its memory
ends with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.benchmarks.export_memory import GIB, BenchError
from tests.benchmarks.kit import REPO


def sweep_bandwidth(gib: float = 4.0, repeats: int = 3) -> dict:
    """Bytes/s of one thread summing a >= ``gib`` GiB float32 array (best of ``repeats``);
    run in a child with one BLAS/OpenMP thread."""
    import numpy as np

    a = np.ones(int(gib * GIB) // 4, dtype=np.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return {"gib": gib, "best_seconds": best, "bytes_per_s": a.nbytes / best}


def chained_tokens(export_dir: Path, prompt: list[int], n: int, threads: int) -> dict:
    """Greedy tokens of every stage chained in this process (the reference for the served run)."""
    from engine.generation.in_process import greedy_generate
    from engine.shards.stage import LocalChain

    chain = LocalChain.load(export_dir, num_threads=threads)
    r = greedy_generate(chain, prompt, n, ignore_eos=True)
    return {"tokens": list(r.tokens), "decode_tok_per_s": r.decode_tok_per_s, "ttft_s": r.ttft_s}


async def served_tokens(export_dir: Path, prompt: list[int], n: int, threads: int, rounds: int = 2) -> dict:
    """The same prompt through one loopback worker process per stage (``threads`` each)."""
    from engine.generation.request import GenerationRequest
    from engine.tools.local_fleet import paged_local_fleet

    out: dict = {"rounds": []}
    async with paged_local_fleet(export_dir, slots=1, threads=threads) as coordinator:
        for _ in range(rounds):
            stamps, tokens = [], []
            started = time.perf_counter()
            async for ev in coordinator.stream(GenerationRequest(tuple(prompt), n, ignore_eos=True)):
                stamps.append(time.perf_counter())
                tokens.append(ev.token_id)
            decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
            out["rounds"].append({"tokens": tokens, "ttft_s": stamps[0] - started, "decode_tok_per_s": decode})
    out["tokens"] = out["rounds"][-1]["tokens"]
    out["decode_tok_per_s"] = max(r["decode_tok_per_s"] for r in out["rounds"])
    return out


def _child(kind: str, payload: dict) -> dict:
    """Run one of the measurements above in a fresh interpreter (its memory is its own and ends)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    child = [sys.executable, "-m", "tests.benchmarks.export_memory_serve", "--child", kind, json.dumps(payload)]
    done = subprocess.run(child,
                          cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchError(f"the {kind} step failed (exit {done.returncode}): {done.stderr[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child_main(kind: str, payload: dict) -> dict:
    import asyncio

    if kind == "bandwidth":
        return sweep_bandwidth(payload["gib"])
    export_dir, prompt = Path(payload["export"]), payload["prompt"]
    if kind == "chained":
        return chained_tokens(export_dir, prompt, payload["tokens"], payload["threads"])
    if kind == "served":
        return asyncio.run(served_tokens(export_dir, prompt, payload["tokens"], payload["threads"]))
    raise BenchError(f"unknown child step {kind!r}")


def serve_phase(export_dir: Path, tokens: int = 16, threads: int = 1, prompt_len: int = 16) -> dict:
    """Served (worker processes) vs chained (one process) tokens, and the bandwidth bound."""
    import numpy as np

    from engine.shards.manifest import load_manifest

    manifest = load_manifest(export_dir)
    vocab = manifest.model.vocab_size if hasattr(manifest.model, "vocab_size") else 32000
    prompt = [int(x) for x in np.random.default_rng(5).integers(10, min(vocab, 32000), prompt_len)]
    bw = _child("bandwidth", {"gib": 4.0})
    chained = _child("chained", {"export": str(export_dir), "prompt": prompt, "tokens": tokens, "threads": threads})
    served = _child("served", {"export": str(export_dir), "prompt": prompt, "tokens": tokens, "threads": threads})
    weight_bytes = sum(f.size for s in manifest.stages for f in s.files if f.path.endswith(".bin"))
    bound = bw["bytes_per_s"] / weight_bytes
    return {"prompt": prompt, "tokens": tokens, "threads_per_worker": threads, "bandwidth": bw,
            "weight_bytes_per_token": weight_bytes, "bound_tok_per_s": bound,
            "chained": chained, "served": served, "tokens_equal": chained["tokens"] == served["tokens"],
            "served_fraction_of_bound": served["decode_tok_per_s"] / bound}


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--child":
        sys.exit("usage: python -m tests.benchmarks.export_memory_serve --child KIND JSON (run by serve_phase)")
    print(json.dumps(_child_main(sys.argv[2], json.loads(sys.argv[3]))))
