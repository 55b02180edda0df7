"""CI runs the README's test command as written: bootstrap, the fast lane (`-m "not slow"`), then
the slow lane (`-m slow`), so every test runs exactly once; a failing lane, or a lane that
collects nothing (pytest's exit 5), fails the run. The script itself is run here, on a copy of
the tree whose bootstrap and `python3` are stand-ins that record what they were asked."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LANES = ['python3 -m pytest -m "not slow"', "python3 -m pytest -m slow"]


def _readme_test_command() -> str:
    lines = [line for line in (ROOT / "README.md").read_text().splitlines()
             if line.startswith("bash installer/bootstrap.sh && ") and "pytest" in line]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_readme_command_is_the_two_lanes_and_ci_runs_it_verbatim():
    command = _readme_test_command()
    assert command.split(" && ") == ["bash installer/bootstrap.sh", *LANES]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci


def _tree(tmp_path: Path, answers: dict[str, int]) -> tuple[Path, dict[str, str]]:
    """A copy of .ci/run beside a bootstrap that succeeds and a `python3` that answers each lane
    with the exit code in ``answers`` (keyed by its -m expression), logging its arguments."""
    tree = tmp_path / "tree"
    (tree / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", tree / ".ci" / "run")
    (tree / "installer").mkdir()
    (tree / "installer" / "bootstrap.sh").write_text("echo bootstrap >> \"$LOG\"\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    cases = "\n".join(f'  "{lane}") exit {rc} ;;' for lane, rc in answers.items())
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> "$LOG"\ncase "$4" in\n{cases}\nesac\nexit 99\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "LOG": str(tmp_path / "log")}
    return tree, env


@pytest.mark.parametrize("fast, slow, expected_rc, ran", [
    (0, 0, 0, ["bootstrap", "-m pytest -m not slow", "-m pytest -m slow"]),
    (1, 0, 1, ["bootstrap", "-m pytest -m not slow"]),  # the fast lane fails first
    (0, 1, 1, ["bootstrap", "-m pytest -m not slow", "-m pytest -m slow"]),
    (5, 0, 1, ["bootstrap", "-m pytest -m not slow"]),  # no tests collected is a failure
    (0, 5, 1, ["bootstrap", "-m pytest -m not slow", "-m pytest -m slow"]),
])
def test_ci_runs_the_fast_lane_first_and_fails_when_either_lane_fails(tmp_path, fast, slow, expected_rc, ran):
    tree, env = _tree(tmp_path, {"not slow": fast, "slow": slow})
    done = subprocess.run(["bash", str(tree / ".ci" / "run")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == expected_rc, done.stdout + done.stderr
    assert (tmp_path / "log").read_text().splitlines() == ran
