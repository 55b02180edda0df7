"""Models already on this PC (issue 34): Ollama's, LM Studio's and the Hugging Face cache's stores,
built here in the layouts those tools write, listed with their quantisation and whether this fleet
can serve them, and added to a running fleet service by reference without a copy."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from console.fleet.models import check_model_path
from console.fleet.models_cli import local_path
from export.model_stores import StoreRefError, find_models, resolve_ref
from tests.support.chat_gguf import write_chat_gguf


def _ollama_store(root: Path, gguf_bytes: bytes, *, name: str = "tiny", tag: str = "latest",
                  namespace: str = "library") -> Path:
    digest = hashlib.sha256(gguf_bytes).hexdigest()
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(gguf_bytes)
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": len(gguf_bytes)},
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 10}]}))
    return blob


def _foreign_gguf(path: Path, arch: str) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def chat_gguf(tmp_path_factory) -> bytes:
    return write_chat_gguf(tmp_path_factory.mktemp("gguf") / "chat.gguf").read_bytes()


def test_every_store_is_listed_with_its_quantisation_and_whether_it_can_be_served(tmp_path, chat_gguf):
    _ollama_store(tmp_path / "ollama", chat_gguf)
    _ollama_store(tmp_path / "ollama", chat_gguf, name="tiny", tag="q8", namespace="acme")
    lm = tmp_path / "lmstudio" / "acme" / "Tiny-GGUF"
    lm.mkdir(parents=True)
    (lm / "tiny-Q8_0.gguf").write_bytes(chat_gguf)
    _foreign_gguf(lm / "falcon-Q4_K_M.gguf", "falcon")
    _foreign_gguf(lm / "gpt-oss-20b-MXFP4.gguf", "gpt-oss")
    (lm / "notes.txt").write_text("not a model")
    found = find_models({"ollama": [tmp_path / "ollama"], "lmstudio": [tmp_path / "lmstudio"],
                         "hf-cache": [tmp_path / "hf"]})
    rows = {m.ref: (m.kind, m.quant, m.size_bytes, m.problem) for m in found}
    quant = rows["ollama:tiny:latest"][1]
    assert quant == "F32"  # no general.file_type in the test GGUF: the type of its matrices
    assert rows["ollama:tiny:latest"] == ("gguf", quant, len(chat_gguf), None)
    assert rows["ollama:acme/tiny:q8"][3] is None
    assert rows["lmstudio:acme/Tiny-GGUF/tiny-Q8_0.gguf"][3] is None
    kind, q, _, problem = rows["lmstudio:acme/Tiny-GGUF/falcon-Q4_K_M.gguf"]
    assert q == "Q4_K_M" and problem is not None and "architecture 'falcon' is not supported" in problem
    assert "attention sinks" in rows["lmstudio:acme/Tiny-GGUF/gpt-oss-20b-MXFP4.gguf"][3]  # refused with its reason
    assert len(rows) == 5


def test_a_damaged_manifest_or_a_missing_blob_is_skipped_not_fatal(tmp_path, chat_gguf):
    blob = _ollama_store(tmp_path, chat_gguf, name="gone")
    blob.unlink()
    bad = tmp_path / "manifests" / "registry.ollama.ai" / "library" / "bad" / "latest"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    assert find_models({"ollama": [tmp_path]}) == []


def test_a_store_reference_resolves_and_a_blob_is_linked_under_a_gguf_name(tmp_path, chat_gguf, monkeypatch):
    blob = _ollama_store(tmp_path / "ollama", chat_gguf)
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("DESKFLEET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_ref("ollama:tiny").path == blob  # the tag defaults to latest, as in ollama
    with pytest.raises(StoreRefError, match="names 0 models in ollama's store.*found: tiny:latest"):
        resolve_ref("ollama:llama3.2")
    with pytest.raises(StoreRefError, match="not a store reference"):
        resolve_ref("docker:tiny")
    link = local_path("ollama:tiny")
    assert link.name == "tiny-latest.gguf" and link.is_symlink() and link.resolve() == blob.resolve()
    assert local_path("ollama:tiny") == link  # again: the same link
    entry = check_model_path(link)
    assert (entry.name, entry.kind, entry.path) == ("tiny-latest", "gguf", link)
    assert blob.stat().st_nlink == 1  # linked, not copied or hard-linked


def test_the_models_command_lists_what_it_found(tmp_path, chat_gguf):
    _ollama_store(tmp_path / "ollama", chat_gguf)
    env = {**os.environ, "OLLAMA_MODELS": str(tmp_path / "ollama"), "HOME": str(tmp_path),
           "HF_HOME": str(tmp_path / "hf"), "DESKFLEET_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "engine.cli.main", "models"], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("ollama:tiny:latest"))
    assert "yes" in line and "deskfleet models add ollama:tiny:latest" in line


@pytest.mark.slow
def test_add_puts_an_ollama_model_into_the_running_services_library(tmp_path, chat_gguf):
    from tests.support.service_process import ServiceProcess

    blob = _ollama_store(tmp_path / "ollama", chat_gguf)
    env = {**os.environ, "OLLAMA_MODELS": str(tmp_path / "ollama"), "DESKFLEET_CACHE": str(tmp_path / "cache")}
    service = ServiceProcess(tmp_path / "state", tmp_path / "service.log", mdns=False)

    async def main():
        admin = await service.start()
        try:
            result = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "engine.cli.main", "models", "add", "ollama:tiny",
                                 "--state-dir", str(tmp_path / "state")], capture_output=True, text=True,
                timeout=120, env=env)
            _, body = await admin.call("GET", "/models")
            return result, body["models"]
        finally:
            await admin.close()
            await service.stop()

    result, models = asyncio.run(main())
    assert result.returncode == 0, result.stderr
    added = [m for m in models if m["name"] == "tiny-latest"]
    assert len(added) == 1 and Path(added[0]["path"]).resolve() == blob.resolve(), models
    nowhere = subprocess.run([sys.executable, "-m", "engine.cli.main", "models", "add", "ollama:tiny",
                              "--state-dir", str(tmp_path / "no-fleet")], capture_output=True, text=True,
                             timeout=120, env=env)
    assert nowhere.returncode != 0 and "no fleet service runs" in nowhere.stderr
