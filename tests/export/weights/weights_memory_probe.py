"""Child process for tests/export/weights/test_weights_memory.py: lower every tensor of a checkpoint through
StageWeights (file-backed), save the IR, and print this process's memory marks as JSON.

``build`` is VmHWM right after the graph is built (the kernel's own peak, reset before work
starts): everything quantisation held at once. ``end`` is after ``ov.save_model``, which pages
the mapped weight file in (file-backed, not anonymous).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from export.weights.checkpoint import open_checkpoint
from export.weights.stage_weights import StageWeights, WeightMode


def status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def main(checkpoint: Path, out: Path, kind: str) -> None:
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = status()
    source = open_checkpoint(checkpoint)
    ids = ops.parameter([-1], np.int64, name="ids")
    params, results = [ids], []
    with StageWeights(source, WeightMode(kind, 64), bin_path=out / "scratch.weights") as weights:
        for name in sorted(source.names()):
            shape = source.shape(name)
            if len(shape) == 1:
                results.append(ops.reduce_sum(weights.vector(name), [0]))
            elif "embed_tokens" in name:
                results.append(ops.gather(weights.embedding(name), ids, 0))
            else:
                x = ops.parameter([-1, shape[1]], np.float32, name=f"x{len(params)}")
                params.append(x)
                results.append(ops.matmul(x, weights.linear(name), False, True))
        build = status()
    model = ov.Model(results, params)
    ov.save_model(model, out / "m.xml", compress_to_fp16=False)
    end = status()
    largest = max(int(np.prod(source.shape(n))) * 4 for n in source.names())
    print(json.dumps({"base": base, "build": build, "end": end, "bin": (out / "m.bin").stat().st_size,
                      "largest_f32": largest, "left": sorted(p.name for p in out.iterdir())}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
