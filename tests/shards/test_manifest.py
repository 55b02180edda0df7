"""Manifest parsing and file verification (pure file I/O), and that a stage compiles the bytes it verified."""

import json
import re

import numpy as np
import pytest

from engine.errors import ManifestError, ShardIntegrityError
from engine.shards.manifest import file_entry, parse_manifest, safe_join, verify_files


@pytest.mark.parametrize("rel", ["../x", "/etc/passwd", "a/../../b", "", "a\\..\\b"])
def test_safe_join_refuses_escapes(tmp_path, rel):
    with pytest.raises(ManifestError):
        safe_join(tmp_path, rel)


def test_safe_join_allows_nested_paths(tmp_path):
    assert safe_join(tmp_path, "stage_0/model.xml") == (tmp_path / "stage_0" / "model.xml").resolve()


def test_verify_files_detects_each_kind_of_damage(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"0123456789")
    entry = file_entry(tmp_path, f)
    verify_files(tmp_path, (entry,))
    f.write_bytes(b"0123456780")
    with pytest.raises(ShardIntegrityError, match="sha256"):
        verify_files(tmp_path, (entry,))
    f.write_bytes(b"01234")
    with pytest.raises(ShardIntegrityError, match="truncated"):
        verify_files(tmp_path, (entry,))
    f.unlink()
    with pytest.raises(ShardIntegrityError, match="missing"):
        verify_files(tmp_path, (entry,))


def test_malformed_manifests_are_explained(tiny_export):
    good = json.loads((tiny_export("llama", 2) / "manifest.json").read_text())
    assert parse_manifest(good).splits == (2,)
    broken = json.loads(json.dumps(good))
    del broken["model"]["hidden_size"]
    with pytest.raises(ManifestError, match="malformed"):
        parse_manifest(broken)
    gap = json.loads(json.dumps(good))
    gap["stages"][1]["first_layer"] = 3
    with pytest.raises(ManifestError, match="inconsistent layer range"):
        parse_manifest(gap)
    short = json.loads(json.dumps(good))
    short["stages"] = short["stages"][:1]
    with pytest.raises(ManifestError, match="do not cover every layer"):
        parse_manifest(short)


@pytest.mark.parametrize("drop", [".xml", ".bin"])
def test_a_stage_whose_graph_or_weights_are_not_hashed_is_refused_at_parse_time(tiny_export, drop):
    good = json.loads((tiny_export("llama", 2) / "manifest.json").read_text())
    assert parse_manifest(good).stages[1].xml == "stage_1/openvino_model.xml"  # an export listing both loads
    bad = json.loads(json.dumps(good))
    bad["stages"][1]["files"] = [f for f in bad["stages"][1]["files"] if not f["path"].endswith(drop)]
    with pytest.raises(ManifestError, match=f"stage 1 compiles stage_1/openvino_model.xml.*{drop}.*re-export"):
        parse_manifest(bad)


def test_moe_entries_round_trip_and_older_manifests_read_as_dense(tiny_export):
    """A MoE export's per-stage entries survive to_json/parse; one without them (an older
    exporter's) reads as dense; a dense export writes none; a nonsensical entry is refused."""
    moe = json.loads((tiny_export("qwen3_moe", 2) / "manifest.json").read_text())
    manifest = parse_manifest(moe)
    assert manifest.moe is not None and all(s.moe is not None for s in manifest.stages)
    assert parse_manifest(json.loads(manifest.to_json())) == manifest
    older = json.loads(json.dumps(moe))
    for stage in older["stages"]:
        del stage["moe"]
    assert parse_manifest(older).moe is None and all(s.moe is None for s in parse_manifest(older).stages)
    dense = json.loads((tiny_export("llama", 2) / "manifest.json").read_text())
    assert all("moe" not in s for s in dense["stages"]) and parse_manifest(dense).moe is None
    bad = json.loads(json.dumps(moe))
    bad["stages"][0]["moe"]["per_token"] = 9  # more experts per token than the 8 there are
    with pytest.raises(ManifestError, match="inconsistent mixture-of-experts"):
        parse_manifest(bad)
    del bad["stages"][0]["moe"]["per_token"]
    with pytest.raises(ManifestError, match="malformed"):
        parse_manifest(bad)


def _stage_logits(stage) -> np.ndarray:
    from engine.shards.stage import StepInputs

    ids = np.array([[1, 87, 85, 267]], dtype=np.int64)
    step = StepInputs(ids, np.ones((1, 4), dtype=np.int64), np.arange(4, dtype=np.int64)[None])
    return stage.new_stream().forward(step)


class _SwappingCore:
    """A real OpenVINO core that, between the stage's hash check and its read_model, swaps the
    weights file on disk for another of the same size (what a same-user attacker would race)."""

    def __init__(self, swap):
        import openvino as ov

        self.core, self.swap, self.swapped = ov.Core(), swap, 0

    def read_model(self, *args, **kwargs):
        self.swap()
        self.swapped += 1
        return self.core.read_model(*args, **kwargs)

    def compile_model(self, *args, **kwargs):
        return self.core.compile_model(*args, **kwargs)


def test_what_is_hashed_is_what_gets_compiled_even_if_the_file_is_swapped_in_between(tiny_export, tmp_path):
    import os
    import shutil

    import openvino as ov

    from engine.shards.stage import Stage

    export = tmp_path / "export"
    shutil.copytree(tiny_export("llama", 1), export)
    weights = export / "stage_0" / "openvino_model.bin"
    forged = tmp_path / "forged.bin"
    data = bytearray(weights.read_bytes())
    xml = (export / "stage_0" / "openvino_model.xml").read_text()
    for offset, size in re.findall(r'element_type="f32" shape="[^"]*" offset="(\d+)" size="(\d+)"', xml):
        if int(size) >= 1024:  # the weight matrices, scaled: same size, other answers
            start = int(offset)
            data[start:start + int(size)] = (np.frombuffer(data, np.float32, int(size) // 4, start) * 1.5).tobytes()
    forged.write_bytes(bytes(data))
    reference = _stage_logits(Stage(export, 0))

    def swap():
        shutil.copy(forged, tmp_path / "forged-copy.bin")
        os.replace(tmp_path / "forged-copy.bin", weights)

    core = _SwappingCore(swap)
    stage = Stage(export, 0, core=core)
    assert core.swapped == 1 and weights.read_bytes() == bytes(data)  # the file on disk is the forged one
    np.testing.assert_array_equal(_stage_logits(stage), reference)
    # the check can fail: compiled by path (the old way), the forged weights answer differently
    by_path = ov.Core().compile_model(ov.Core().read_model(export / "stage_0" / "openvino_model.xml"), "CPU",
                                      stage.properties)
    stage.compiled = by_path
    assert not np.array_equal(_stage_logits(stage), reference)
    with pytest.raises(ShardIntegrityError, match="openvino_model.bin does not match"):
        Stage(export, 0)  # swapped before the hash: refused
