"""Calibration: how long one decode step of a stage takes on this PC's device.

The console profiles each candidate device before placing a model: it sends an agent two small
stages of a calibration export (e.g. 1 and 2 decoder layers, no embedding or head), the agent
times a decode step of each on the device, and the console fits placement's per-layer time
t[d] (the slope) and per-stage overhead o[d] (the intercept). Timing runs in a subprocess of
the agent (``python -m engine.shards.calibration``), so OpenVINO never lives in the agent process.

Steps decode at a context of ``context`` tokens after a prefill of that length, with synthetic
hidden states: the time of a layer does not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.shards.stage import Stage, StepInputs


@dataclass(frozen=True)
class StageTiming:
    stage: int
    layers: int
    step_ms: float  # median decode step
    compile_s: float
    threads: int | None = None  # the inference threads the compiled stage ran with


def time_stage(shard_dir: Path, index: int, *, device: str = "CPU", steps: int = 16, context: int = 64,
               threads: int | None = None, seed: int = 0) -> StageTiming:
    """Median decode-step time of stage ``index`` (it must take hidden states: not stage 0)."""
    started = time.perf_counter()
    stage = Stage(shard_dir, index, device=device, num_threads=threads)
    compile_s = time.perf_counter() - started
    if stage.spec.has_embedding:
        raise ValueError(f"stage {index} starts with the embedding; calibrate a middle stage")
    hidden = stage.spec.activation_input_width or stage.manifest.model.hidden_size
    rng = np.random.default_rng(seed)
    stream = stage.new_stream()
    x = rng.standard_normal((1, context, hidden), dtype=np.float32) * 0.1
    mask = np.ones((1, context), dtype=np.int64)
    stream.forward(StepInputs(x, mask, np.arange(context, dtype=np.int64)[None, :]))
    times = []
    for k in range(steps):
        pos = context + k
        step = StepInputs(rng.standard_normal((1, 1, hidden), dtype=np.float32) * 0.1,
                          np.ones((1, pos + 1), dtype=np.int64), np.array([[pos]], dtype=np.int64))
        t0 = time.perf_counter()
        stream.forward(step)
        times.append((time.perf_counter() - t0) * 1e3)
    ran_with = int(stage.compiled.get_property("INFERENCE_NUM_THREADS"))
    return StageTiming(index, stage.spec.num_layers, float(np.median(times)), compile_s, ran_with)


def fit_layer_time(timings: list[StageTiming]) -> tuple[float, float]:
    """(layer_ms, overhead_ms) by least squares over stages of different layer counts; the
    per-layer time is floored at a small positive value and the overhead at zero, since noise
    on a loaded PC can make a 2-layer stage look no slower than a 1-layer one."""
    layers = np.array([t.layers for t in timings], dtype=np.float64)
    ms = np.array([t.step_ms for t in timings], dtype=np.float64)
    if len(set(layers.tolist())) < 2:
        raise ValueError("calibration needs stages of at least two different layer counts")
    slope, intercept = np.polyfit(layers, ms, 1)
    slope = max(float(slope), 1e-3)
    return slope, max(float(intercept), 0.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.shards.calibration", description=__doc__.splitlines()[0])
    p.add_argument("--shard", type=Path, required=True)
    p.add_argument("--stages", required=True, help="comma-separated stage indices")
    p.add_argument("--device", default="CPU")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    out = [time_stage(args.shard, int(s), device=args.device, steps=args.steps, context=args.context,
                      threads=args.threads).__dict__ for s in args.stages.split(",")]
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
