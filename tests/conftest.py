"""Shared fixtures: tiny random checkpoints and their exports (built once per test session), the
unsplit greedy reference, a private keyring and private XDG folders, and the hygiene guards."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

# Importing openvino starts a non-daemon ThreadPoolExecutor worker that lives until exit. Import it
# once here, before any test, so a test whose body is the first to import it is not taken for
# leaking that thread by ``no_leaked_threads``.
import openvino  # noqa: E402, F401

FAMILIES = ("llama", "llama3", "qwen2", "mistral")
PROMPT_IDS = (1, 87, 85, 267, 201, 299, 266, 286, 273, 391, 265, 384, 33, 2, 201, 1, 301)


@pytest.fixture(scope="session", autouse=True)
def _chats_in_the_sessions_folder(tmp_path_factory):
    """The chat windows keep their chats (console/shared/conversations.py) in this session's own
    folder, never in the user's data directory; processes the tests start inherit it."""
    os.environ.setdefault("DESKFLEET_CHATS_DIR", str(tmp_path_factory.mktemp("chats")))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(family)`` -> directory of a random-weight HF checkpoint with a tokenizer."""
    from tests.support.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-ckpt")
    built: dict[str, Path] = {}

    def get(family: str = "llama") -> Path:
        if family not in built:
            built[family] = build_tiny_model(root / family, family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory, tiny_checkpoint):
    """``tiny_export(family, stages, weights, beam_idx)`` -> export directory (cached per session)."""
    from export.exporter import ExportOptions, export_model

    root = tmp_path_factory.mktemp("tiny-export")
    done: dict[tuple, Path] = {}

    def get(family: str = "llama", stages: int = 1, weights: str = "fp32", beam_idx: bool = True,
            kv: str = "f32") -> Path:
        key = (family, stages, weights, beam_idx, kv)
        if key not in done:
            out = root / "-".join(map(str, key))
            options = ExportOptions(weights=weights, group_size=16, kv_cache_precision=kv, beam_idx=beam_idx)
            export_model(tiny_checkpoint(family), out, stages=stages, options=options)
            done[key] = out
        return done[key]

    return get


@pytest.fixture(scope="session")
def tiny_calibration(tmp_path_factory, tiny_checkpoint):
    """A state dir holding the tiny llama's fp32 calibration exports (built once per session;
    copy its ``calibration`` folder into a console's or service's state dir before placing)."""
    from console.fleet.calibration_export import build_calibration_set
    from export.exporter import ExportOptions

    root = tmp_path_factory.mktemp("tiny-calibration")
    build_calibration_set(tiny_checkpoint("llama"), root, ExportOptions(weights="fp32"))
    return root


@pytest.fixture(scope="session")
def hf_greedy(tiny_checkpoint):
    """``hf_greedy(family, n)`` -> HF torch fp32 greedy continuation of PROMPT_IDS."""
    import torch
    from transformers import AutoModelForCausalLM

    cache: dict[tuple, tuple[int, ...]] = {}

    def get(family: str, n: int = 32) -> tuple[int, ...]:
        if (family, n) not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family), dtype=torch.float32)
            ids = torch.tensor([PROMPT_IDS])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
            cache[(family, n)] = tuple(out[0, len(PROMPT_IDS):].tolist())
        return cache[(family, n)]

    return get


@pytest.fixture(scope="session")
def unsplit_greedy(tiny_export):
    """``unsplit_greedy(prompt=PROMPT_IDS, n=12)`` -> the exact greedy tokens of the tiny llama as
    one in-process stage: what every ring, fleet and failover must reproduce (cached)."""
    from engine.generation.in_process import greedy_generate
    from engine.shards.stage import LocalChain

    chain = None
    cache: dict[tuple, tuple[int, ...]] = {}

    def get(prompt=PROMPT_IDS, n: int = 12) -> tuple[int, ...]:
        nonlocal chain
        key = (tuple(prompt), n)
        if key not in cache:
            chain = chain or LocalChain.load(tiny_export("llama", 1), exact=True)
            cache[key] = greedy_generate(chain, prompt, n, ignore_eos=True).tokens
        return cache[key]

    return get


@pytest.fixture
def private_keyring(tmp_path, monkeypatch):
    """The keyring (``DESKFLEET_KEYRING_DIR``) in the test's own directory, never the user's."""
    from engine.envvars import KEYRING_DIR

    monkeypatch.setenv(KEYRING_DIR, str(tmp_path / "keyring"))


@pytest.fixture
def private_dirs(private_keyring, tmp_path, monkeypatch):
    """The keyring, ``XDG_CONFIG_HOME`` (autostart entries) and ``XDG_DATA_HOME`` (agent and
    console state) in the test's own directory: for the shells, which use all three."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))


@pytest.fixture(scope="module")
def module_dirs(tmp_path_factory):
    """``private_dirs`` for a whole module: the keyring and XDG dirs a module's one fleet service
    (and every console and agent beside it) uses, never the user's."""
    from engine.envvars import KEYRING_DIR

    root = tmp_path_factory.mktemp("dirs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KEYRING_DIR, str(root / "keyring"))
        patch.setenv("XDG_CONFIG_HOME", str(root / "config"))
        patch.setenv("XDG_DATA_HOME", str(root / "data"))
        yield


@pytest.fixture
def no_server_errors(caplog):
    """Fail a live fuzz test whose servers logged an error: aiohttp logs an unhandled handler
    exception at ERROR before it answers 500 (the fuzz modules use it through LIVE_FUZZ)."""
    from tests.support.fuzz_helpers import unexpected_errors

    caplog.set_level(logging.WARNING)
    yield
    errors = unexpected_errors(caplog.records, ("aiohttp", "agent", "deskfleet", "engine"))
    assert not errors, errors[:5]


def _qt_event_loops_run() -> bool:
    """True unless the QApplication is stuck quitting: after QCoreApplication.quit()/exit() (or a
    Quit event) outside ``app.exec()``, every later QEventLoop.exec() returns at once, so
    qtbot.wait* and queued signals silently stop working for the rest of the session."""
    import sys

    if "PySide6.QtWidgets" not in sys.modules:
        return True
    from PySide6.QtCore import QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    if QApplication.instance() is None:
        return True
    ran: list[int] = []
    loop = QEventLoop()
    QTimer.singleShot(0, lambda: (ran.append(1), loop.quit()))
    loop.exec()
    return bool(ran)


@pytest.fixture(autouse=True)
def qt_application_still_runs_event_loops():
    """Fail the test that leaves the QApplication quitting (and repair it for the tests after)."""
    yield
    if not _qt_event_loops_run():
        from PySide6.QtCore import QTimer
        from PySide6.QtWidgets import QApplication

        app = QApplication.instance()
        QTimer.singleShot(0, app.quit)
        app.exec()  # exec() clears the quitting flag on its way in and out
        pytest.fail("this test left the QApplication quitting (QCoreApplication.quit/exit outside app.exec()): "
                    "later event loops would return at once")


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Fail a test that leaves non-daemon threads running (they would hang the process at exit)."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
    for t in leaked:
        t.join(timeout=5)
    still = [t.name for t in leaked if t.is_alive()]
    assert not still, f"test leaked running threads: {still}"


@pytest.fixture(scope="session")
def default_checkpoint():
    """The embedded SmolLM2-135M-Instruct as an HF checkpoint (converted once, cached on disk)."""
    from export.sources import resolve_model

    return resolve_model(None).checkpoint_dir


@pytest.fixture(scope="session")
def default_export_int4(tmp_path_factory, default_checkpoint):
    """The embedded default model exported as 2 INT4 stages."""
    from export.exporter import ExportOptions, export_model

    out = tmp_path_factory.mktemp("default") / "int4-2"
    export_model(default_checkpoint, out, stages=2, options=ExportOptions(weights="int4", group_size=64),
                 name="SmolLM2-135M-Instruct")
    return out
