"""The ``deskfleet`` command line, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def deskfleet(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_every_command():
    result = deskfleet("--help")
    assert result.returncode == 0
    for command in ("export", "generate", "models", "serve"):
        assert command in result.stdout


def test_export_then_generate_on_a_tiny_model(tiny_checkpoint, tmp_path):
    out = tmp_path / "shards"
    result = deskfleet("export", str(tiny_checkpoint("qwen2")), "--split", "1,3", "--weights", "int8",
                       "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "exported" in result.stdout and "3 int8 stage(s)" in result.stdout
    assert "stage 2" in result.stderr  # one progress bar per stage
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(s["first_layer"], s["last_layer"]) for s in manifest["stages"]] == [(0, 0), (1, 2), (3, 3)]
    assert manifest["stages"][0]["kv_cache_precision"] == "f16"

    answer = deskfleet("generate", "--shards", str(out), "--prompt", "What is the capital of France?",
                       "--max-new-tokens", "12")
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip(), "the model must say something"
    assert "tok/s" in answer.stderr and "3 stages" in answer.stderr


def test_errors_are_one_clear_line_without_traceback(tmp_path, tiny_checkpoint):
    result = deskfleet("generate", "--shards", str(tmp_path / "missing"), "--prompt", "hi")
    assert result.returncode == 1
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
    bad = deskfleet("export", str(tmp_path), "--stages", "2", "--out", str(tmp_path / "o"))
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    keep = deskfleet("export", str(tiny_checkpoint("llama")), "--stages", "1", "--weights", "keep",
                     "--out", str(tmp_path / "k"))
    assert keep.returncode == 1 and "needs a .gguf model" in keep.stderr and "Traceback" not in keep.stderr
    assert not (tmp_path / "k").exists()


def test_export_requires_a_split():
    result = deskfleet("export", "--out", "x")
    assert result.returncode == 2 and "--stages" in result.stderr


@pytest.mark.slow
def test_models_lists_the_embedded_default():
    result = deskfleet("models")
    assert result.returncode == 0, result.stderr
    assert "SmolLM2-135M-Instruct" in result.stdout
