"""The console's model library: models the admin adds (checked, persisted), export jobs in a real
background process (progress in order, the exporter's own failure message, cancel leaves nothing),
and reuse of an identical export, including one asked for by a placement plan."""

from __future__ import annotations

import os
import signal
import time

import pytest

from console.fleet.errors import ExportCancelledError, ExportJobError, ModelPathError
from console.fleet.export_job import PREPARE_STEPS, STAGE_STEPS, export_fraction
from console.fleet.models import ModelLibrary
from console.fleet_api.exports import ExportFinished, ExportKey, ExportProgress, ExportSpec
from engine.placement.types import Plan, PlannedStage
from engine.shards.manifest import load_manifest, verify_files

SPEC = ExportSpec(weights="fp32", kv_cache_precision="f32")
TIMEOUT = 300.0


def _plan(*ranges: tuple[int, int]) -> Plan:
    stages = tuple(PlannedStage(f"pc-{i}/CPU", f"pc-{i}", a, b, 1.0, 1 << 20) for i, (a, b) in enumerate(ranges))
    return Plan(stages=stages, hop_ms=(0.0,) * (len(stages) + 1), per_token_ms=1.0, tok_s=1000.0, bottleneck_ms=1.0,
                n_streams=1, cycle_ms=1.0, aggregate_tok_s=1000.0, objective="latency", optimal=True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_checkpoint):
    """One 2-stage export made by a background job: (library, events, export info)."""
    library = ModelLibrary(tmp_path_factory.mktemp("console"))
    events = []
    job = library.start_export(tiny_checkpoint("llama"), stages=2, spec=SPEC, on_event=events.append)
    info = job.wait(TIMEOUT)
    assert job.state == "finished" and not job.reused
    return library, events, info


def test_an_export_job_reports_every_step_in_order_and_leaves_a_verified_export(exported):
    library, events, info = exported
    progress = [e for e in events if isinstance(e, ExportProgress)]
    expected = [(None, s) for s in PREPARE_STEPS] + [(stage, s) for stage in (0, 1) for s in STAGE_STEPS]
    assert [(e.stage, e.step) for e in progress] == expected
    fractions = [e.fraction for e in progress]
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(0.9) and fractions[2] == 0.0
    assert isinstance(events[-1], ExportFinished) and events[-1].export == info and not events[-1].reused

    manifest = load_manifest(info.path)
    for stage in manifest.stages:
        verify_files(info.path, stage.files)
    assert info.path.parent == library.exports_dir and info.path.name == info.export_id
    assert (info.stages, info.split, info.layers, info.weights) == (2, (2,), ((0, 1), (2, 3)), "fp32")
    assert info.fingerprint == manifest.model.fingerprint and len(info.fingerprint) == 64
    assert info.size_bytes == sum(f.size for s in manifest.stages for f in s.files) + \
        sum(f.size for f in manifest.tokenizer_files) > 0
    assert library.exports() == [info] and library.export(info.export_id) == info
    assert not [p for p in library.exports_dir.iterdir() if p.name.startswith(".")]  # no partial left


def test_an_identical_export_is_reused_also_when_a_plan_asks_for_it(exported, tiny_checkpoint):
    library, _, info = exported
    before = {p: p.stat().st_mtime_ns for p in info.path.rglob("*")}
    for how in ({"stages": 2}, {"split": [2]}, {"plan": _plan((0, 1), (2, 3))}):
        events = []
        job = library.start_export(tiny_checkpoint("llama"), spec=SPEC, on_event=events.append, **how)
        assert job.wait(TIMEOUT) == info and job.reused, how
        assert not [e for e in events if isinstance(e, ExportProgress) and e.stage is not None]
    assert {p: p.stat().st_mtime_ns for p in info.path.rglob("*")} == before  # nothing rewritten
    assert library.exports() == [info]
    # another split or other weights are another export
    assert library.find(info.key) == info
    assert library.find(ExportKey.of_request(info.fingerprint, [1], SPEC)) is None
    assert library.find(ExportKey.of_request(info.fingerprint, [2], ExportSpec(weights="int8"))) is None


def test_the_exporters_own_message_reaches_the_console(tmp_path, tiny_checkpoint):
    library = ModelLibrary(tmp_path / "console")
    job = library.start_export(tiny_checkpoint("llama"), split=[9], spec=SPEC)
    with pytest.raises(ExportJobError) as failed:
        job.wait(TIMEOUT)
    assert failed.value.kind == "ExportError" and "out of range" in str(failed.value)
    assert "4 layers" in str(failed.value) and job.state == "failed"
    assert library.exports() == [] and not any(library.exports_dir.iterdir())


def test_cancel_mid_export_terminates_the_process_and_leaves_no_directory(tmp_path, tiny_checkpoint):
    library = ModelLibrary(tmp_path / "console")
    events = []
    job = library.start_export(tiny_checkpoint("llama"), stages=4, spec=SPEC, on_event=events.append)
    deadline = time.monotonic() + TIMEOUT
    while not any(isinstance(e, ExportProgress) and e.stage == 1 for e in events):
        assert time.monotonic() < deadline and not job.done, events
        job.poll(0.5)
    assert [p for p in library.exports_dir.iterdir() if p.name.startswith(".")], "no partial export to cancel"
    pid = job.pid
    assert job.cancel() and job.state == "cancelled"
    assert not job._process.is_alive() and job._process.exitcode != 0, pid
    assert list(library.exports_dir.iterdir()) == []
    with pytest.raises(ExportCancelledError):
        job.wait(1)
    assert not job.cancel()  # once is enough


def test_an_export_process_killed_from_outside_is_a_failure_that_leaves_nothing(tmp_path, tiny_checkpoint):
    library = ModelLibrary(tmp_path / "console")
    job = library.start_export(tiny_checkpoint("llama"), stages=4, spec=SPEC)
    deadline = time.monotonic() + TIMEOUT
    while not any(p.name.startswith(".") for p in library.exports_dir.iterdir()):
        assert time.monotonic() < deadline and not job.done
        job.poll(0.2)
    os.kill(job.pid, signal.SIGKILL)  # the OOM killer, say
    with pytest.raises(ExportJobError, match="without a result") as died:
        job.wait(60)
    assert died.value.kind == "ProcessDied" and job.state == "failed"
    assert list(library.exports_dir.iterdir()) == []


def test_models_are_checked_persisted_and_bad_paths_explained(tmp_path, tiny_checkpoint):
    library = ModelLibrary(tmp_path / "console")
    default = library.models()[0]
    assert default.kind == "default" and default.path is None

    with pytest.raises(ModelPathError, match="does not exist"):
        library.add_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelPathError, match="config.json"):
        library.add_model(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelPathError, match="not a model"):
        library.add_model(tmp_path / "notes.txt")
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04 a zip")
    with pytest.raises(ModelPathError, match="not a GGUF"):
        library.add_model(tmp_path / "fake.gguf")
    with pytest.raises(ModelPathError, match="does not exist"):
        library.start_export(tmp_path / "nowhere", stages=1)
    assert not library.exports_dir.exists()  # nothing was started

    ckpt = tiny_checkpoint("llama")
    entry = library.add_model(ckpt)
    assert (entry.kind, entry.path, entry.available) == ("hf", ckpt.resolve(), True)
    library.add_model(ckpt)  # twice: still one entry
    reopened = ModelLibrary(tmp_path / "console")
    assert [m.path for m in reopened.models()[1:]] == [ckpt.resolve()]
    reopened.remove_model(ckpt)
    assert ModelLibrary(tmp_path / "console").models()[1:] == []


def test_progress_fraction_covers_every_stage_step():
    assert export_fraction(None, "fingerprint", 3) == 0.0
    steps = [export_fraction(stage, step, 3) for stage in range(3) for step in STAGE_STEPS]
    assert steps == sorted(steps) and len(set(steps)) == len(steps) and steps[0] == 0.0 and steps[-1] < 1.0
    assert export_fraction(1, "static", 2) == export_fraction(1, "stateful", 2)
