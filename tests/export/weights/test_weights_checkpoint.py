"""export.weights.checkpoint: safetensors directories read through memory maps, f32/f16/bf16."""

from __future__ import annotations

import json

import numpy as np
import pytest

from export.weights.checkpoint import CheckpointError, SafetensorsSource, open_checkpoint


def _write_checkpoint(directory, tensors_by_file, config=None):
    """Write HF-style safetensors files through torch (the independent writer)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    for file, tensors in tensors_by_file.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / file))
    return torch


@pytest.fixture(scope="module")
def mixed_checkpoint(tmp_path_factory):
    import torch

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.f32": torch.randn(7, 5, generator=gen),
        "b.f16": torch.randn(3, 9, generator=gen).to(torch.float16),
        "c.bf16": (torch.randn(11, 4, generator=gen) * 100).to(torch.bfloat16),
        "d.vec": torch.randn(6, generator=gen).to(torch.bfloat16),
    }
    directory = tmp_path_factory.mktemp("mixed")
    _write_checkpoint(directory, {"model-00001-of-00002.safetensors": dict(list(tensors.items())[:2]),
                                  "model-00002-of-00002.safetensors": dict(list(tensors.items())[2:])},
                      config={"model_type": "llama", "hidden_size": 5})
    expected = {k: v.to(torch.float32).numpy() for k, v in tensors.items()}
    return directory, expected


def test_reads_every_dtype_exactly_as_torch_widens_it(mixed_checkpoint):
    directory, expected = mixed_checkpoint
    source = open_checkpoint(directory)
    assert source.config == {"model_type": "llama", "hidden_size": 5}
    assert source.names() == frozenset(expected)
    for name, want in expected.items():
        got = source.read(name)
        assert got.dtype == np.float32 and got.flags.c_contiguous
        assert source.shape(name) == want.shape
        np.testing.assert_array_equal(got, want)
    assert source.dtype("c.bf16") == "BF16"
    source.close()


def test_read_rows_is_a_slice_of_read(mixed_checkpoint):
    directory, expected = mixed_checkpoint
    source = SafetensorsSource(directory)
    np.testing.assert_array_equal(source.read_rows("c.bf16", 3, 8), expected["c.bf16"][3:8])
    np.testing.assert_array_equal(source.read_rows("a.f32", 0, 0), expected["a.f32"][:0])
    with pytest.raises(CheckpointError, match="outside"):
        source.read_rows("a.f32", 5, 9)


def test_read_returns_a_writable_copy_not_a_view_of_the_file(mixed_checkpoint):
    directory, expected = mixed_checkpoint
    source = SafetensorsSource(directory)
    got = source.read("a.f32")
    got[:] = 0
    np.testing.assert_array_equal(source.read("a.f32"), expected["a.f32"])


def test_bad_checkpoints_are_explained(tmp_path, mixed_checkpoint):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text("{}")
        SafetensorsSource(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="not JSON"):
        SafetensorsSource(tmp_path)
    with pytest.raises(CheckpointError, match="missing"):
        SafetensorsSource(mixed_checkpoint[0]).read("nope")
    with pytest.raises(CheckpointError, match="neither"):
        open_checkpoint(tmp_path / "x.bin")
    # A truncated file is refused, not read past its end.
    directory = tmp_path / "trunc"
    _write_checkpoint(directory, {"m.safetensors": {"w": __import__("torch").ones(64, 64)}})
    data = (directory / "m.safetensors").read_bytes()
    (directory / "m.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsSource(directory)


def test_a_tensor_in_two_files_is_refused(tmp_path):
    import torch

    _write_checkpoint(tmp_path, {"a.safetensors": {"w": torch.ones(2)}, "b.safetensors": {"w": torch.ones(2)}})
    with pytest.raises(CheckpointError, match="both"):
        SafetensorsSource(tmp_path)


def test_streamed_synthetic_checkpoint_reads_back_in_torch_and_here(tmp_path):
    import torch
    from safetensors import safe_open

    from tests.support.synthetic_checkpoint import LlamaShape, llama_tensors, write_synthetic_llama

    shape = LlamaShape(layers=2, hidden=64, intermediate=96, heads=4, kv_heads=2, vocab=300)
    directory = write_synthetic_llama(tmp_path / "ckpt", shape, dtype="BF16", seed=3)
    source = open_checkpoint(directory)
    assert source.names() == frozenset(n for n, _ in llama_tensors(shape))
    assert source.config["num_key_value_heads"] == 2
    with safe_open(str(directory / "model.safetensors"), framework="pt") as st:
        for name in source.names():
            want = st.get_tensor(name)
            assert want.dtype == torch.bfloat16
            np.testing.assert_array_equal(source.read(name), want.float().numpy())
    source.close()


def test_raw_bytes_fingerprint_equals_the_torch_one_and_sees_every_byte(mixed_checkpoint, tmp_path):
    import shutil

    from export.sources import model_fingerprint as torch_fingerprint
    from export.weights.fingerprint import (
        checkpoint_fingerprint,
        gguf_fingerprint,
        model_fingerprint,
    )

    directory, _ = mixed_checkpoint
    assert checkpoint_fingerprint(directory) == torch_fingerprint(directory) == model_fingerprint(directory)
    changed = tmp_path / "changed"
    shutil.copytree(directory, changed)
    last = sorted(changed.glob("*.safetensors"))[-1]
    data = bytearray(last.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor's last value
    last.write_bytes(bytes(data))
    assert checkpoint_fingerprint(changed) != checkpoint_fingerprint(directory)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    first = gguf_fingerprint(gguf)
    assert model_fingerprint(gguf) == first and first != checkpoint_fingerprint(directory)
    gguf.write_bytes(b"GGUF" + bytes(99) + b"\1")
    assert gguf_fingerprint(gguf) != first


TORCH_FREE_PROBE = """
import sys
from pathlib import Path
from tests.support.synthetic_checkpoint import LlamaShape, write_synthetic_llama
from export.weights.checkpoint import open_checkpoint
from export.weights.stage_weights import StageWeights, WeightMode
from export.weights.fingerprint import model_fingerprint
import export.gguf_tokenizer, export.weights.gguf_source, export.weights.gguf_blocks
d = write_synthetic_llama(Path(sys.argv[1]), LlamaShape(1, 64, 96, 4, 2, 128), dtype="BF16")
source = open_checkpoint(d)
for kind in ("int4_sym", "int4_asym", "int8_asym", "fp16", "fp32"):
    with StageWeights(source, WeightMode(kind, 32), bin_path=Path(sys.argv[1]) / "scratch") as w:
        w.linear("model.layers.0.mlp.down_proj.weight"), w.embedding("model.embed_tokens.weight")
model_fingerprint(d)
print(sorted(m for m in ("torch", "transformers", "nncf", "safetensors", "optimum") if m in sys.modules))
"""


def test_reading_lowering_and_fingerprinting_import_no_torch(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", TORCH_FREE_PROBE, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
