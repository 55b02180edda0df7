"""Bad requests and damaged shards give clear errors and leave nothing half-written."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from engine.errors import DeskfleetError, ManifestError, ShardIntegrityError
from engine.shards.manifest import load_manifest
from engine.shards.stage import LocalChain, Stage
from export.builder.families import UnsupportedModelError
from export.exporter import ExportError, ExportOptions, export_model, plan_stages
from export.options import CompressionError


def _leftovers(parent, name):
    return [p.name for p in parent.iterdir() if name in p.name]


def test_tampered_shard_is_refused_before_compiling(tiny_export, tmp_path, monkeypatch):
    export = tmp_path / "copy"
    shutil.copytree(tiny_export("llama", 2), export)
    weights = export / "stage_1" / "openvino_model.bin"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    compiled = []
    monkeypatch.setattr("openvino.Core.compile_model", lambda *a, **k: compiled.append(a))
    with pytest.raises(ShardIntegrityError, match="stage_1/openvino_model.bin.*sha256"):
        Stage(export, 1)
    assert compiled == [], "nothing may be compiled from a shard that fails verification"


def test_truncated_and_missing_shard_files_are_named(tiny_export, tmp_path):
    export = tmp_path / "copy"
    shutil.copytree(tiny_export("llama", 2), export)
    xml = export / "stage_0" / "openvino_model.xml"
    xml.write_bytes(xml.read_bytes()[:100])
    with pytest.raises(ShardIntegrityError, match="truncated"):
        LocalChain.load(export)
    xml.unlink()
    with pytest.raises(ShardIntegrityError, match="missing"):
        LocalChain.load(export)


def test_missing_directory_and_missing_manifest(tmp_path):
    with pytest.raises(ManifestError, match="does not exist"):
        load_manifest(tmp_path / "nowhere")
    with pytest.raises(ManifestError, match="no manifest.json"):
        load_manifest(tmp_path)


@pytest.mark.parametrize("tamper", ["extra file", "graph and weights"])
def test_manifest_path_escaping_the_export_is_refused(tiny_export, tmp_path, tamper):
    export = tmp_path / "copy"
    shutil.copytree(tiny_export("llama", 1), export)
    manifest = json.loads((export / "manifest.json").read_text())
    stage = manifest["stages"][0]
    if tamper == "extra file":
        # The graph and weights stay listed (parsing requires them), so only the escape can refuse it.
        stage["files"].append({**stage["files"][0], "path": "../../etc/passwd"})
        escaping = "../../etc/passwd"
    else:
        # The stage compiles a graph outside the export, consistently listed with its weights.
        moved = {stage["xml"]: "../../etc/openvino_model.xml",
                 stage["xml"].replace(".xml", ".bin"): "../../etc/openvino_model.bin"}
        assert set(moved) <= {f["path"] for f in stage["files"]}
        for entry in stage["files"]:
            entry["path"] = moved.get(entry["path"], entry["path"])
        stage["xml"] = escaping = "../../etc/openvino_model.xml"
    (export / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"(unsafe|escapes).*" + escaping.replace(".", r"\.")):
        Stage(export, 0)


def test_unknown_manifest_version_is_refused(tiny_export, tmp_path):
    export = tmp_path / "copy"
    shutil.copytree(tiny_export("llama", 1), export)
    manifest = json.loads((export / "manifest.json").read_text())
    manifest["format_version"] = 99
    (export / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="version 99"):
        load_manifest(export)


@pytest.mark.parametrize(("stages", "split", "message"), [
    (0, None, "out of range"),
    (5, None, "out of range"),
    (None, [0], "out of range"),
    (None, [4], "out of range"),
    (None, [3, 2], "out of range"),
])
def test_split_out_of_range_writes_nothing(stages, split, message, tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=message):
        export_model(tiny_checkpoint("llama"), out, stages=stages, split=split, fingerprint="x")
    assert not out.exists() and _leftovers(tmp_path, "out") == []


def test_plan_stages_is_contiguous_and_balanced():
    plan = plan_stages(30, stages=4)
    assert [(s.first_layer, s.last_layer) for s in plan] == [(0, 7), (8, 15), (16, 22), (23, 29)]
    assert plan[0].has_embedding and plan[-1].has_head and not plan[1].has_head
    assert [s.first_layer for s in plan_stages(30, split=[10, 20])] == [0, 10, 20]


def test_unsupported_architecture_names_what_is_supported(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    ckpt = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(ckpt)
    out = tmp_path / "out"
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported.*llama.*mistral.*qwen2"):
        export_model(ckpt, out, stages=1, fingerprint="x")
    assert not out.exists()


def test_gpt_oss_is_refused_by_name_with_the_reason(tmp_path):
    """A gpt-oss checkpoint (``model_type: gpt_oss``) is refused before any work with what the builder
    lacks for it, not only the list of what it supports (its GGUF: tests/export/test_gguf_families.py)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    ckpt = tmp_path / "gpt-oss"
    GptOssForCausalLM(GptOssConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=32, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                   vocab_size=64)).save_pretrained(ckpt)
    out = tmp_path / "out"
    with pytest.raises(UnsupportedModelError, match="gpt-oss is not supported yet: .*attention sinks.*sliding-window"
                                                    ".*MXFP4.*; supported: .*qwen3_moe"):
        export_model(ckpt, out, stages=1, fingerprint="x")
    assert not out.exists()


def test_group_size_that_does_not_divide_hidden_size(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(CompressionError, match="group size 48 does not divide hidden size"):
        export_model(tiny_checkpoint("llama"), out, stages=1, options=ExportOptions(group_size=48), fingerprint="x")
    assert not out.exists()


def test_existing_output_is_kept_unless_forced(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(ExportError, match="already exists"):
        export_model(tiny_checkpoint("llama"), out, stages=1, options=ExportOptions(weights="fp32"), fingerprint="x")
    assert (out / "precious.txt").read_text() == "keep me"


def test_failure_mid_export_leaves_no_partial_directory(tiny_checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "out"

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("export.exporter._commit", boom)  # every stage and the tokenizer written, then the failure
    with pytest.raises(RuntimeError, match="disk full"):
        export_model(tiny_checkpoint("llama"), out, stages=2, options=ExportOptions(weights="fp32"), fingerprint="x")
    assert not out.exists() and _leftovers(tmp_path, "out") == []


def test_not_a_checkpoint_directory(tmp_path):
    with pytest.raises(DeskfleetError, match="config.json"):
        export_model(tmp_path, tmp_path / "out", stages=1, fingerprint="x")


def test_a_tensor_no_stage_reads_is_refused_by_name(tiny_checkpoint, tmp_path):
    """A qwen2 checkpoint with an o_proj bias (qwen2 has none): the builder would never read it,
    so the export refuses it by name instead of dropping it (the rotary buffers older HF
    checkpoints carry are dropped on purpose)."""
    from safetensors.numpy import load_file, save_file

    ckpt = tmp_path / "qwen2-extra"
    shutil.copytree(tiny_checkpoint("qwen2"), ckpt)
    weights = ckpt / "model.safetensors"
    tensors = load_file(weights)
    hidden = tensors["model.norm.weight"].shape[0]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    save_file(tensors, weights)
    export_model(ckpt, tmp_path / "fine", stages=1, options=ExportOptions(weights="fp32"), fingerprint="x")
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.ones(hidden, np.float32)
    save_file(tensors, weights)
    out = tmp_path / "out"
    with pytest.raises(ExportError, match=r"no stage of this Qwen2.*'model\.layers\.0\.self_attn\.o_proj\.bias'"):
        export_model(ckpt, out, stages=2, options=ExportOptions(weights="fp32"), fingerprint="x")
    assert not out.exists()
