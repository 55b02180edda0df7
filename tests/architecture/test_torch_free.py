"""torch leaves the product: ``deskfleet export`` (every target) and the console never import it.

Each check runs in a fresh interpreter (this test process has torch loaded for the oracles) and
reports its ``sys.modules`` at the end. The tiny models are built here with the test tools.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.shards.manifest import load_manifest
from export.exporter import ExportError, ExportOptions, export_model

pytest.importorskip("gguf")
ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "nncf", "optimum")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from tests.support.chat_gguf import write_chat_gguf

    return write_chat_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_llama(tiny_checkpoint) -> Path:
    # Built before the per-test thread check: transformers' save leaves a pool thread behind.
    return tiny_checkpoint("llama")


def _run(script: str, tmp_path: Path, timeout: float = 300) -> dict:
    """Run ``script`` in a fresh interpreter; it prints one JSON line last."""
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "DESKFLEET_CACHE": str(tmp_path / "cache"),
           "DESKFLEET_KEYRING_DIR": str(tmp_path / "keyring"), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


_EXPORT_CLI = """
import json, sys
from engine.cli.main import main
code = main(["export", {model!r}, "--stages", "2", "--weights", {weights!r}, "--out", {out!r}])
print(json.dumps({{"code": code, "heavy": [m for m in {heavy!r} if m in sys.modules]}}))
"""


@pytest.mark.parametrize("kind", ["safetensors", "gguf", "gguf keep"])
def test_deskfleet_export_imports_no_torch(kind, tiny_llama, tiny_gguf, tmp_path):
    model = tiny_llama if kind == "safetensors" else tiny_gguf
    weights = "keep" if kind == "gguf keep" else "int4"
    out = tmp_path / "export"
    report = _run(_EXPORT_CLI.format(model=str(model), weights=weights, out=str(out), heavy=HEAVY), tmp_path)
    assert report == {"code": 0, "heavy": []}
    manifest = load_manifest(out)
    assert len(manifest.stages) == 2 and manifest.weights.format == weights
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    if kind != "safetensors":  # the GGUF's own bytes identify it (no conversion in between)
        from export.weights.fingerprint import gguf_fingerprint

        assert manifest.model.fingerprint == gguf_fingerprint(tiny_gguf)


def test_keep_needs_a_gguf(tiny_llama, tmp_path):
    with pytest.raises(ExportError, match="keep.*needs a .gguf"):
        export_model(tiny_llama, tmp_path / "out", stages=1, options=ExportOptions(weights="keep"),
                     fingerprint="x")
    assert not (tmp_path / "out").exists()


def test_the_console_exports_and_calibrates_without_torch(tiny_llama, tiny_gguf, tmp_path):
    """The console started as `deskfleet console` starts (offscreen), then an export job and a
    calibration run the way its pages run them; torch is never loaded into the console process
    (the job's spawned process runs ``export_job._export``, which is also run here in-process)."""
    script = f"""
    import argparse, asyncio, json, sys
    from pathlib import Path
    from console.qt.app import run_console
    from console.qt.cli import COMMAND
    from console.fleet import export_job
    from console.fleet.calibration_export import async_build_calibration_set
    from console.fleet.export_job import ExportJob, ExportRequest
    from export.options import ExportOptions

    parser = argparse.ArgumentParser()
    COMMAND.configure(parser)
    state = Path({str(tmp_path / "state")!r})
    args = parser.parse_args(["--state-dir", str(state), "--interface", "127.0.0.1", "--api-port", "0",
                              "--enrollment-port", "0", "--hub-port", "0", "--data-port", "0",
                              "--admin-port", "-1"])
    seen = {{}}

    def exercise(window):
        # The export job (its own process, as the models page starts it) ...
        job = ExportJob(ExportRequest({str(tiny_gguf)!r}, state / "exports", stages=2)).start()
        info = job.wait(240)
        seen["job"] = [info.path.name, job.state]
        # ... the same work in this process, to see its imports here too ...
        sent = []
        export_job._export(ExportRequest({str(tiny_gguf)!r}, state / "exports2", stages=2), sent.append)
        seen["inline"] = type(sent[-1]).__name__
        # ... and a calibration, which the console runs in a worker thread of its own process.
        calibration = asyncio.run(async_build_calibration_set(Path({str(tiny_llama)!r}), state,
                                                              ExportOptions(weights="int4")))
        seen["calibration"] = [len(p.manifest.stages) for p in calibration.parts]

    code = run_console(args, until=exercise)
    heavy = [m for m in {HEAVY!r} if m in sys.modules]
    # The console started a local fleet service (closing the console stops nothing): stop it.
    from console.fleet_api.service_locator import read_service_file
    service = read_service_file(state)
    if service is not None:
        import os, signal
        os.kill(service.pid, signal.SIGTERM)
    print(json.dumps({{"code": code, **seen, "heavy": heavy, "service": service is not None}}))
    """
    report = _run(script, tmp_path, timeout=600)
    assert report["service"], "the console started no local fleet service"
    assert report["code"] == 0
    assert report["job"][1] == "finished"
    assert report["inline"] == "_Done"
    assert report["calibration"] == [3, 3], "a 4-layer model calibrates with two 3-stage exports"
    assert report["heavy"] == [], f"the console process imported {report['heavy']}"
    job_export = tmp_path / "state" / "exports" / report["job"][0]
    assert load_manifest(job_export).weights.format == "int4"


def test_npu_target_of_a_gguf_is_built_from_its_tensors(tiny_gguf, tmp_path, monkeypatch):
    """The NPU target reads a GGUF as the CPU/GPU targets do: no transformers conversion first."""
    monkeypatch.setenv("DESKFLEET_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "npu"
    report = export_model(tiny_gguf, out, stages=2, fingerprint="x",
                          options=ExportOptions(weights="fp16", target="npu", context=32))
    assert [s.graphs[0].name for s in report.manifest.stages] == ["decode", "decode"]
    assert load_manifest(out).static.context == 32
    assert not (tmp_path / "cache" / "hf-checkpoints").exists()
    assert (out / "tokenizer" / "tokenizer.json").is_file()
