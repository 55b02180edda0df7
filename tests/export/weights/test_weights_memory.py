"""A stage's weights are never whole in anonymous memory (issue 13, memory).

A bf16 Llama-shaped checkpoint of ~220 MB (f32 embedding 131 MB) is lowered tensor by tensor in
a child process, whose kernel-reported peak RSS is read before and after saving.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.synthetic_checkpoint import LlamaShape, write_synthetic_llama

pytestmark = pytest.mark.slow

MB = 1024 * 1024
SHAPE = LlamaShape(layers=4, hidden=1024, intermediate=2816, heads=16, kv_heads=4, vocab=32000)
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def synthetic_checkpoint(tmp_path_factory):
    return write_synthetic_llama(tmp_path_factory.mktemp("synthetic") / "ckpt", SHAPE, dtype="BF16", seed=1)


@pytest.mark.parametrize("kind", ["int4_asym", "fp16"])
def test_peak_memory_is_one_row_block_plus_the_mapped_stage(kind, synthetic_checkpoint, tmp_path):
    assert (synthetic_checkpoint / "model.safetensors").stat().st_size > 200 * MB
    done = subprocess.run([sys.executable, "-m", "tests.export.weights.weights_memory_probe", str(synthetic_checkpoint),
                           str(tmp_path), kind], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    base = report["base"]["VmRSS"]
    build_growth = report["build"]["VmHWM"] - base
    total_growth = report["end"]["VmHWM"] - base
    # Building the whole ~220 MB checkpoint's graph held no more than a row block's temporaries:
    # well under the largest tensor (the 131 MB f32 embedding; 65 MB as stored).
    assert build_growth < 56 * MB, report
    assert build_growth < report["largest_f32"] / 2, report
    # Saving pages the mapped weight file in (file-backed); the bound holds with room.
    assert total_growth <= 1.3 * report["bin"] + 64 * MB, report
    assert report["end"]["RssAnon"] - report["base"]["RssAnon"] < 48 * MB, report
    assert report["left"] == ["m.bin", "m.xml"]  # the scratch weight file is gone
