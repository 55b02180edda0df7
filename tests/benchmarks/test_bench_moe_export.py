"""``python -m tests.benchmarks moe-export`` on its toy shape: the streamed Qwen3-MoE checkpoint reads
back as the builder's MoE, and one whole run (export child, worker process, records) works."""

from __future__ import annotations

import argparse
import json
import math

from export.builder.families import model_shape
from export.weights.checkpoint import open_checkpoint
from tests.benchmarks.moe_export import TOY, active_bytes, run, write_moe_checkpoint
from tests.support.synthetic_checkpoint import QWEN3_30B_A3B, qwen3_moe_tensors


def test_the_synthetic_is_a_qwen3_moe_checkpoint_the_builder_reads(tmp_path):
    ckpt = write_moe_checkpoint(tmp_path / "toy", TOY, seed=1)
    source = open_checkpoint(ckpt)
    shape = model_shape(source.config)
    assert shape.moe is not None and shape.moe.layers == frozenset(range(TOY.layers))
    assert (shape.moe.experts, shape.moe.per_token, shape.moe.intermediate) == (8, 2, 32)
    assert source.names() == {name for name, _ in qwen3_moe_tensors(TOY)}
    one, other = (source.read(f"model.layers.1.mlp.experts.{e}.up_proj.weight") for e in (3, 4))
    assert 0.04 < float(one.std()) < 0.06 and not (one == other).all()  # random, and not one expert copied


def test_the_real_shape_is_qwen3_30b_a3b():
    n = sum(math.prod(dims) for _, dims in qwen3_moe_tensors(QWEN3_30B_A3B))
    assert 30.0e9 < n < 31.0e9  # "30B"
    experts = 3 * QWEN3_30B_A3B.expert_intermediate * QWEN3_30B_A3B.hidden * QWEN3_30B_A3B.layers
    assert 3.0e9 < n - experts * (QWEN3_30B_A3B.experts - QWEN3_30B_A3B.per_token) < 3.5e9  # "A3B"


def test_a_toy_run_exports_serves_and_records(tmp_path):
    args = argparse.Namespace(work=tmp_path / "work", layers=2, group_size=16, tokens=6, threads=1, seed=0,
                              keep=True, toy=True, render_only=False, json=tmp_path / "moe.json",
                              doc=tmp_path / "BENCH.md")
    assert run(args) == 0
    result = json.loads(args.json.read_text())
    assert result["serve"]["tokens_equal"] and result["serve"]["served"]["decode_tok_per_s"] > 0
    assert result["export"]["ok"] and result["bytes"]["per_token"] == 2
    assert result["bytes"] == active_bytes(args.work / "int4-1", TOY.vocab, TOY.hidden)
    doc = args.doc.read_text()
    assert "<!-- moe-export:start -->" in doc and "python -m tests.benchmarks moe-export --toy --layers 2" in doc
    assert "Extrapolated to all 48 layers" in doc
