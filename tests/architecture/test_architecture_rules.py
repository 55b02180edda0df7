"""The dependency rules of ARCHITECTURE.md: import-linter's contracts, and no import cycles.

Each rule is also run on a copy of the tree with a bad import added, to show it can fail.
"""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "export", "agent", "console", "installer")
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or [sys.executable, "-m", "importlinter.cli"]
    cmd = [exe] if isinstance(exe, str) else exe
    return subprocess.run([*cmd, "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300)


def _tree_copy(tmp_path: Path) -> Path:
    """The five packages and pyproject.toml, copied: a tree to add bad imports to."""
    tree = tmp_path / "tree"
    for part in PACKAGES:
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def _lint_tree(tree: Path) -> subprocess.CompletedProcess:
    """import-linter on ``tree``, importing its packages, not the installed ones."""
    return subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); "
                           "from importlinter.cli import lint_imports_command; lint_imports_command()",
                           "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=300)


def _cycles(root: Path) -> subprocess.CompletedProcess:
    script = Path(__file__).with_name("import_graph.py")
    return subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken" in result.stdout


def test_contracts_catch_a_torch_import_in_engine_and_in_the_console(tmp_path):
    """The same contracts on a copy of the tree with bad imports must fail, naming each."""
    tree = _tree_copy(tmp_path)
    (tree / "engine" / "sneaky.py").write_text("import torch\n")
    # The console reaching torch through the exporter's CPU/GPU path (not the ignored NPU edge).
    (tree / "export" / "sneaky_export.py").write_text("def f():\n    import transformers\n")
    (tree / "console" / "fleet" / "sneaky.py").write_text("from export import sneaky_export\n")
    result = _lint_tree(tree)
    assert result.returncode != 0
    assert "engine.sneaky -> torch" in result.stdout
    assert "console.fleet.sneaky -> export.sneaky_export" in result.stdout
    assert "export.sneaky_export -> transformers" in result.stdout


def test_the_layers_contract_catches_an_upward_import(tmp_path):
    """A lower floor of engine reaching up (the wire importing the coordinator) breaks the build."""
    tree = _tree_copy(tmp_path)
    (tree / "engine" / "wire" / "sneaky.py").write_text("from engine.paged import ring_path\n")
    result = _lint_tree(tree)
    assert result.returncode != 0
    assert "engine.wire.sneaky -> engine.paged.ring_path" in result.stdout


def test_the_shell_contracts_catch_the_agent_reaching_into_the_console(tmp_path):
    """The agent may import console.shared and nothing else of the console; console.shared
    imports nothing else of the console; no product package imports the installer. One bad
    import of each kind breaks exactly those three contracts, each named."""
    tree = _tree_copy(tmp_path)
    (tree / "agent" / "tray" / "sneaky.py").write_text("from console.qt import service_bridge\n")
    (tree / "console" / "shared" / "sneaky.py").write_text("def f():\n    from console.fleet import fleet\n")
    (tree / "console" / "sneaky.py").write_text("from installer import deb\n")
    result = _lint_tree(tree)
    assert result.returncode != 0
    assert "agent.tray.sneaky -> console.qt.service_bridge" in result.stdout
    assert "console.shared.sneaky -> console.fleet.fleet" in result.stdout
    assert "console.sneaky -> installer.deb" in result.stdout
    assert f"Contracts: {len(CONTRACTS) - 3} kept, 3 broken" in result.stdout


def test_no_import_cycles_between_modules():
    """engine, export, agent, console and installer import in one direction only: no two modules
    need each other through any chain (function-local and TYPE_CHECKING imports included)."""
    result = _cycles(ROOT)
    assert result.returncode == 0, "import cycles:\n" + result.stdout + result.stderr
    assert result.stdout.strip() == "no import cycles"


def test_the_cycle_check_catches_a_cycle_hidden_in_a_function_or_behind_type_checking(tmp_path):
    """A copy of the tree with the control API importing the service again (under TYPE_CHECKING,
    as it once did) and a function-local import closing a loop through export fails, naming both."""
    tree = _tree_copy(tmp_path)
    api = tree / "agent" / "service" / "control_api.py"
    api.write_text(api.read_text() + "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                   "    from agent.service.service import AgentService\n")
    (tree / "export" / "weights" / "sneaky.py").write_text("def f():\n    from export import exporter\n")
    exporter = tree / "export" / "exporter.py"
    exporter.write_text(exporter.read_text() + "\nfrom export.weights import sneaky\n")
    result = _cycles(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout
    assert re.fullmatch(r"agent\.service\.control_api \(l\.\d+\) -> agent\.service\.service \(l\.\d+\) "
                        r"-> agent\.service\.control_api", lines[0]), lines[0]
    assert re.fullmatch(r"export\.exporter \(l\.\d+\) -> export\.weights\.sneaky \(l\.2\) -> export\.exporter",
                        lines[1]), lines[1]
