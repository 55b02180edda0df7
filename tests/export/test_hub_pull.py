"""``deskfleet models pull`` (issue 34): the real ``huggingface_hub`` client code path against a hub
on loopback (tests/support/local_hub.py) serving tiny repositories built here: the files chosen, a
transfer cut in the middle and resumed, a damaged file refused and deleted, too little disk refused
before any transfer, and the command as a user runs it (HF_ENDPOINT, HF_HOME)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import HfApi

from export.hub_pull import HubFile, PullError, choose_files, plan_pull, pull
from export.model_stores import find_models
from tests.support.chat_gguf import write_chat_gguf
from tests.support.local_hub import LocalHub, serving

BIG = bytes(range(256)) * 96_000  # 24 MiB: past huggingface_hub's 10 MiB read chunk, so a cut can resume
CHECKPOINT = {"config.json": json.dumps({"model_type": "llama"}).encode(), "model.safetensors": BIG,
              "tokenizer.json": b"{}", "README.md": b"# tiny", "pytorch_model.bin": b"pickle"}


def _files(*names: str) -> list[HubFile]:
    return [HubFile(n, 1) for n in names]


def test_a_checkpoint_pull_takes_config_safetensors_and_tokenizer_never_pickles():
    chosen = choose_files(_files("config.json", "model.safetensors", "tokenizer.json", "pytorch_model.bin",
                                 "README.md", "onnx/model.onnx"))
    assert [f.name for f in chosen] == ["config.json", "model.safetensors", "tokenizer.json"]
    with pytest.raises(PullError, match="PyTorch .bin"):
        choose_files(_files("config.json", "pytorch_model.bin"))


def test_a_gguf_is_chosen_by_quant_or_file_and_an_ambiguous_choice_names_the_files():
    ggufs = _files("m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q8_0.gguf", "big-Q4_K_M-00001-of-00002.gguf")
    assert [f.name for f in choose_files(ggufs, quant="q8_0")] == ["m-Q8_0.gguf"]
    assert [f.name for f in choose_files(ggufs, file="m-Q4_K_S.gguf")] == ["m-Q4_K_S.gguf"]
    with pytest.raises(PullError, match=r"names 2 .*m-Q4_K_M.gguf.*--file"):
        choose_files(ggufs, quant="Q4_K_M")
    with pytest.raises(PullError, match="choose one with --quant"):
        choose_files(ggufs)
    with pytest.raises(PullError, match="split GGUF"):
        choose_files(ggufs, file="big-Q4_K_M-00001-of-00002.gguf")
    with pytest.raises(PullError, match="no file 'x.gguf'"):
        choose_files(ggufs, file="x.gguf")


def test_a_cut_transfer_resumes_with_a_range_and_every_file_is_verified(tmp_path):
    hub = LocalHub({"acme/tiny": CHECKPOINT}, cut_once={"model.safetensors": 15_000_000})
    with serving(hub):
        plan = plan_pull("acme/tiny", api=HfApi(endpoint=hub.url))
        snapshot = pull(plan, cache_dir=tmp_path, endpoint=hub.url, progress=False)
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (snapshot / "model.safetensors").read_bytes() == BIG
    ranges = [r for method, path, r in hub.requests if method == "GET" and path.endswith("/model.safetensors")]
    assert len(ranges) == 2 and ranges[0] is None and ranges[1].startswith("bytes=") and ranges[1] != "bytes=0-"


def test_a_damaged_file_is_refused_and_nothing_of_it_stays_in_the_cache(tmp_path):
    hub = LocalHub({"acme/tiny": CHECKPOINT}, corrupt={"model.safetensors"})
    with serving(hub):
        plan = plan_pull("acme/tiny", api=HfApi(endpoint=hub.url))
        with pytest.raises(PullError, match="model.safetensors arrived damaged .*sha256.*deleted"):
            pull(plan, cache_dir=tmp_path, endpoint=hub.url, progress=False)
    left = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size == len(BIG)]
    assert left == []
    assert not list(tmp_path.rglob("model.safetensors"))


def test_a_small_file_is_checked_against_its_git_blob_id(tmp_path):
    hub = LocalHub({"acme/tiny": CHECKPOINT}, corrupt={"config.json"})
    with serving(hub):
        plan = plan_pull("acme/tiny", api=HfApi(endpoint=hub.url))
        with pytest.raises(PullError, match="config.json arrived damaged .*git blob id"):
            pull(plan, cache_dir=tmp_path, endpoint=hub.url, progress=False)


def test_too_little_disk_is_refused_before_any_transfer(tmp_path):
    hub = LocalHub({"acme/tiny": CHECKPOINT}, listed_sizes={"model.safetensors": 1 << 60})
    with serving(hub):
        plan = plan_pull("acme/tiny", api=HfApi(endpoint=hub.url))
        with pytest.raises(PullError, match=r"needs .* GiB .* free; free some space"):
            pull(plan, cache_dir=tmp_path, endpoint=hub.url, progress=False)
    assert not [r for r in hub.requests if "/resolve/" in r[1]]


def test_an_unknown_repository_is_a_clear_error():
    hub = LocalHub({})
    with serving(hub), pytest.raises(PullError, match="no model 'acme/none'.*HF_TOKEN"):
        plan_pull("acme/none", api=HfApi(endpoint=hub.url))


def _deskfleet(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine.cli.main", *args], capture_output=True, text=True,
                          timeout=180, env={**os.environ, **env})


def test_the_pull_command_honours_hf_endpoint_and_the_pulled_gguf_is_listed_as_servable(tmp_path):
    gguf = write_chat_gguf(tmp_path / "src.gguf").read_bytes()
    repo = {"tiny-Q8_0.gguf": gguf, "tiny-F16.gguf": gguf + b"", "README.md": b"# tiny"}
    hub = LocalHub({"acme/tiny-GGUF": repo})
    env = {"HF_HOME": str(tmp_path / "hf"), "OLLAMA_MODELS": str(tmp_path / "none"), "HOME": str(tmp_path)}
    with serving(hub):
        env["HF_ENDPOINT"] = hub.url
        result = _deskfleet("models", "pull", "acme/tiny-GGUF", "--quant", "Q8_0", "--quiet", env=env)
        missing = _deskfleet("models", "pull", "acme/nothing", env=env)
    assert result.returncode == 0, result.stderr
    pulled = Path(result.stdout.strip().splitlines()[-1])
    assert pulled.name == "tiny-Q8_0.gguf" and hashlib.sha256(pulled.read_bytes()).digest() == hashlib.sha256(
        gguf).digest()
    assert "deskfleet models add" in result.stderr
    assert missing.returncode != 0 and "no model 'acme/nothing'" in missing.stderr and "Traceback" not in missing.stderr
    found = find_models({"hf-cache": [tmp_path / "hf" / "hub"]})
    assert [(m.ref, m.problem) for m in found] == [("hf:acme/tiny-GGUF/tiny-Q8_0.gguf", None)]
