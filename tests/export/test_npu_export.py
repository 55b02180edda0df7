"""`deskfleet export --target npu`: static, stateless graphs built without torch, the 4-D bias,
the manifest, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from engine.errors import ManifestError
from engine.shards.manifest import SUPPORTED_VERSIONS, load_manifest, parse_manifest
from engine.static.packed_stage import StaticChain
from export.exporter import ExportError, ExportOptions, export_model
from export.static_export import StaticShapeError, check_static, dynamic_outputs
from tests.support.npu_helpers import npu_export


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory, tiny_checkpoint):
    return npu_export(tmp_path_factory, tiny_checkpoint("llama"), stages=2, context=64, prefill_chunk=8)


@pytest.fixture(scope="module")
def packed(tmp_path_factory, tiny_checkpoint):
    return npu_export(tmp_path_factory, tiny_checkpoint("llama"), stages=2, context=132, slots=4)


@pytest.mark.slow
def test_every_graph_is_static_and_stateless_with_explicit_kv(unpacked, packed):
    core = ov.Core()
    for export, expected in ((unpacked, {"decode": 1, "prefill": 8}), (packed, {"packed": 4})):
        manifest = load_manifest(export)
        for stage in manifest.stages:
            assert {g.name: g.rows for g in stage.graphs} == expected
            for g in stage.graphs:
                model = core.read_model(export / g.xml)
                assert dynamic_outputs(model) == []
                assert not model.get_sinks()
                assert not [op for op in model.get_ops() if op.get_type_name() in ("ReadValue", "Assign")]
                names = {t.name: t.shape for t in g.inputs}
                window = manifest.static.context - manifest.static.rows
                first = stage.first_layer
                assert names[f"past_key_{first}"] == (1, 2, window, 16)
                assert {t.name: t.shape for t in g.outputs}[f"new_value_{first}"] == (1, 2, g.rows, 16)
                if g.mask == "4d":
                    assert names["attention_bias"] == (1, 1, g.rows, window + g.rows)
                    assert "attention_mask" not in names
                else:
                    assert names["attention_mask"] == (1, window + g.rows)
                assert "beam_idx" not in names and "logits_last" not in names


@pytest.mark.slow
def test_int4_graphs_stay_static_after_compression(tmp_path_factory, tiny_checkpoint):
    export = npu_export(tmp_path_factory, tiny_checkpoint("qwen2"), stages=2, context=48, slots=3, weights="int4")
    manifest = load_manifest(export)
    assert manifest.weights.format == "int4"
    for stage in manifest.stages:
        model = ov.Core().read_model(export / stage.graph("packed").xml)
        assert dynamic_outputs(model) == []
        assert any(op.get_element_type() in (ov.Type.i4, ov.Type.u4)
                   for op in model.get_ops() if op.get_type_name() == "Constant")


def test_static_check_names_a_dynamic_dimension():
    x = ops.parameter(ov.PartialShape([1, -1, 8]), ov.Type.f32, name="hidden")
    model = ov.Model([ops.relu(x)], [x], "one dynamic dim")
    with pytest.raises(StaticShapeError, match=r"after compression: Parameter 'hidden' output 0 \[1,\?,8\]"):
        check_static(model, "after compression")
    model.reshape({0: ov.PartialShape([1, 4, 8])})
    check_static(model, "after reshape")


@pytest.mark.slow
def test_static_check_runs_on_the_graph_as_built(monkeypatch, tiny_checkpoint, tmp_path):
    """A built graph with a dynamic dimension (as a weight subgraph could bring) fails the export,
    and leaves nothing."""
    import export.static_export as static_export

    real = static_export.build_static_stage_model

    def build_that_goes_dynamic(*args, **kwargs):
        model = real(*args, **kwargs)
        extra = ops.parameter(ov.PartialShape([-1]), ov.Type.f32, name="decompression_scale")
        model.add_results([ops.result(ops.relu(extra))])
        model.add_parameters([extra])
        return model

    monkeypatch.setattr(static_export, "build_static_stage_model", build_that_goes_dynamic)
    out = tmp_path / "npu"
    with pytest.raises(StaticShapeError, match="with its weights lowered.*decompression_scale"):
        export_model(tiny_checkpoint("llama"), out, stages=1,
                     options=ExportOptions(weights="fp32", target="npu", context=32))
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_the_4d_bias_gives_the_numbers_of_the_2d_mask(tiny_checkpoint):
    """The packed graph takes one additive mask row per query row instead of one shared 0/1 row:
    built both ways over the same weights, a bias that says what the mask says gives the same
    outputs, bit for bit, new K/V included."""
    from export.builder.families import model_shape
    from export.builder.stage_graph import StagePlan, head_tensor
    from export.builder.static_stage import build_static_stage_model
    from export.weights.checkpoint import open_checkpoint
    from export.weights.stage_weights import StageWeights, WeightMode

    s, w = 8, 63
    with open_checkpoint(tiny_checkpoint("qwen2")) as source:  # qwen2: grouped-query rows folded
        shape = model_shape(source.config)
        stage = StagePlan(0, 0, shape.num_layers - 1, True, True)
        with StageWeights(source, WeightMode("fp32")) as weights:
            head = head_tensor(shape, source.names())
            graphs = {m: build_static_stage_model(shape, stage, weights, head, rows=s, window=w, mask=m)
                      for m in ("2d", "4d")}
            assert shape.groups > 1
            core, props = ov.Core(), {"INFERENCE_PRECISION_HINT": "f32"}
            plain, packed = (core.compile_model(graphs[m], "CPU", props) for m in ("2d", "4d"))
    rng = np.random.default_rng(0)
    feed = {"input_ids": rng.integers(0, 500, (1, s)), "position_ids": np.arange(20, 28)[None]}
    for port in plain.inputs:
        if port.get_any_name().startswith("past_"):
            feed[port.get_any_name()] = rng.standard_normal(tuple(port.get_shape())).astype(np.float32)
    mask = (rng.random((1, w + s)) < 0.5).astype(np.int64)
    mask[0, w:] = 1
    allowed = np.concatenate([np.broadcast_to(mask[0, :w] > 0, (s, w)), np.tril(np.ones((s, s), bool))], 1)
    bias = np.where(allowed, 0, np.finfo(np.float32).min).astype(np.float32)[None, None]
    out_a = plain({**feed, "attention_mask": mask})
    out_b = packed({**feed, "attention_bias": bias})
    assert [p.get_any_name() for p in plain.outputs] == [p.get_any_name() for p in packed.outputs]
    for i in range(len(plain.outputs)):
        np.testing.assert_array_equal(out_a[i], out_b[i])
    shuffled = np.array(bias)
    shuffled[0, 0, 3, :w] = np.where(bias[0, 0, 3, :w] == 0, np.finfo(np.float32).min, 0)
    assert not np.array_equal(packed({**feed, "attention_bias": shuffled})[0][0, 3], out_a[0][0, 3])


@pytest.mark.slow
def test_manifest_round_trip_and_versions(unpacked, packed, tiny_export):
    for export in (unpacked, packed):
        raw = json.loads((export / "manifest.json").read_text())
        assert raw["format_version"] == 2 and raw["target"] == "npu"
        manifest = parse_manifest(raw)
        assert parse_manifest(json.loads(manifest.to_json())) == manifest
    m = load_manifest(packed)
    assert (m.static.context, m.static.slots, m.static.prefill_chunk, m.static.window) == (132, 4, None, 128)
    assert load_manifest(unpacked).static.prefill_chunk == 8
    # A stateful export is still written as version 1 (older builds read it) and still loads.
    old = json.loads((tiny_export("llama", 2) / "manifest.json").read_text())
    assert old["format_version"] == 1 and 1 in SUPPORTED_VERSIONS
    for key in ("target", "static"):
        old.pop(key, None)
    for stage in old["stages"]:
        stage.pop("graphs", None)
    legacy = parse_manifest(old)
    assert legacy.target == "stateful" and legacy.static is None and legacy.stages[0].graphs == ()
    with pytest.raises(ManifestError, match="static serving needs"):
        StaticChain.load(tiny_export("llama", 2))


@pytest.mark.slow
def test_inconsistent_npu_manifests_are_refused(packed):
    good = json.loads((packed / "manifest.json").read_text())

    def broken(edit):
        raw = json.loads(json.dumps(good))
        edit(raw)
        return raw

    cases = [
        (lambda r: r.update(format_version=3), "version 3 is not supported"),
        (lambda r: r.update(static=None), "must record its static context"),
        (lambda r: r.update(target="tpu"), "target 'tpu' is unknown"),
        (lambda r: r["stages"][1].update(graphs=[]), "lists graphs"),
        (lambda r: r["stages"][0]["graphs"][0].update(rows=2), "has 2 rows"),
        (lambda r: r["static"].update(slots=200), "inconsistent static settings"),
    ]
    for edit, why in cases:
        with pytest.raises(ManifestError, match=why):
            parse_manifest(broken(edit))


@pytest.mark.parametrize("options, why", [
    (dict(target="npu"), "needs --context"),
    (dict(target="npu", context=1), "between 2 and"),
    (dict(target="npu", context=100_000), "model's 512 positions"),
    (dict(target="npu", context=32, slots=40), "--slots 40 does not fit --context 32"),
    (dict(target="npu", context=32, slots=11), "at most 10 slots"),
    (dict(target="npu", context=32, slots=0), "at least 1"),
    (dict(target="npu", context=64, slots=4, prefill_chunk=8), "does not apply with --slots"),
    (dict(target="npu", context=64, prefill_chunk=64), "--prefill-chunk 64 must be between"),
    (dict(context=64), "apply to --target npu only"),
    (dict(target="gpu"), "unknown --target"),
])
def test_bad_npu_options_are_refused_before_any_work(options, why, tiny_checkpoint, tmp_path):
    with pytest.raises(ExportError, match=why):
        export_model(tiny_checkpoint("llama"), tmp_path / "o", stages=1, options=ExportOptions(**options))
    assert not (tmp_path / "o").exists()


def _deskfleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli.main", *args], capture_output=True, text=True, timeout=600)


# `deskfleet export --target npu` with torch, transformers and NNCF made unimportable, as on a
# product install: the static graphs are built op by op, nothing is traced.
_WITHOUT_TORCH = """
import sys
sys.modules.update(torch=None, transformers=None, nncf=None, optimum=None)
from engine.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _deskfleet_without_torch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_exports_npu_shards_and_explains_bad_options(tiny_checkpoint, tmp_path):
    ckpt = str(tiny_checkpoint("mistral"))
    out = tmp_path / "npu"
    ok = _deskfleet_without_torch("export", ckpt, "--stages", "2", "--target", "npu", "--context", "40",
                                  "--slots", "2", "--weights", "fp16", "--out", str(out))
    assert ok.returncode == 0, ok.stderr
    assert "static NPU (context 40, 2 slot(s))" in ok.stdout and "graphs packed" in ok.stdout
    assert load_manifest(out).static.slots == 2
    for args, why in [
        (["--target", "npu"], "needs --context"),
        (["--target", "npu", "--context", "16", "--slots", "17"], "--slots 17 does not fit --context 16"),
        (["--target", "npu", "--context", "16", "--kv-cache-precision", "f16"], "stateful shards only"),
        (["--context", "16"], "apply to --target npu only"),
    ]:
        bad = _deskfleet("export", ckpt, "--stages", "1", *args, "--out", str(tmp_path / "bad"))
        assert bad.returncode == 1 and why in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    typo = _deskfleet("export", ckpt, "--stages", "1", "--target", "npu", "--context", "many", "--out", "x")
    assert typo.returncode == 2 and "--context" in typo.stderr


@pytest.mark.slow
def test_each_runtime_refuses_the_other_targets_shards(unpacked, tiny_export, tmp_path):
    from engine.shards.stage import Stage

    with pytest.raises(ManifestError, match="holds npu shards, but this runs stateful shards"):
        Stage(unpacked, 0)
    with pytest.raises(ManifestError, match="holds stateful shards, but this runs npu shards"):
        from engine.shards.manifest import verify_stage

        verify_stage(tiny_export("llama", 1), load_manifest(tiny_export("llama", 1)), 0, target="npu")
    # The commands pick the runtime from the manifest: generate serves an NPU-target export statically.
    answer = _deskfleet("generate", "--shards", str(unpacked), "--prompt", "hi", "--max-new-tokens", "2")
    assert answer.returncode == 0 and "static 1-slot export" in answer.stderr, answer.stderr
