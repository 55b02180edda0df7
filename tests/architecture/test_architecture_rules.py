"""The dependency rules of ARCHITECTURE.md, enforced by import-linter."""

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or [sys.executable, "-m", "importlinter.cli"]
    cmd = [exe] if isinstance(exe, str) else exe
    return subprocess.run([*cmd, "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"Contracts: {len(contracts)} kept, 0 broken" in result.stdout


def test_contracts_catch_a_torch_import_in_engine_and_in_the_console(tmp_path):
    """The same contracts on a copy of the tree with bad imports must fail, naming each."""
    tree = tmp_path / "tree"
    for part in ("engine", "export", "agent", "console", "installer"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    (tree / "engine" / "sneaky.py").write_text("import torch\n")
    # The console reaching torch through the exporter's CPU/GPU path (not the ignored NPU edge).
    (tree / "export" / "sneaky_export.py").write_text("def f():\n    import transformers\n")
    (tree / "console" / "service" / "sneaky.py").write_text("from export import sneaky_export\n")
    result = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); "
                             "from importlinter.cli import lint_imports_command; lint_imports_command()",
                             "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "engine.sneaky -> torch" in result.stdout
    assert "console.service.sneaky -> export.sneaky_export" in result.stdout
    assert "export.sneaky_export -> transformers" in result.stdout


def test_the_layers_contract_catches_an_upward_import(tmp_path):
    """A lower floor of engine reaching up (the wire importing the coordinator) breaks the build."""
    tree = tmp_path / "tree"
    for part in ("engine", "export", "agent", "console", "installer"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    (tree / "engine" / "wire" / "sneaky.py").write_text("from engine.coordinator import ring\n")
    result = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); "
                             "from importlinter.cli import lint_imports_command; lint_imports_command()",
                             "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "engine.wire.sneaky -> engine.coordinator.ring" in result.stdout
