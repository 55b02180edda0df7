"""The benchmarks are harness, not product: the wheel and the .deb carry none of them (nor the
optimum-intel reference, the soak's users, the tiny and synthetic test models), the installed
command has no ``bench``, and every benchmark answers ``--help`` from a clone as
``python -m tests.benchmarks``.

The wheel is built for real (installer.packaging.build_wheel, ~10 s) and the core .deb is laid
out and packed by the installer's own code around it, without its dependencies' wheels.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from installer.build_deb import dpkg_build, stage_package
from installer.packaging import REPO, build_wheel, project_version
from tests.benchmarks.__main__ import BENCHMARKS, PROG, main

# Module names that are harness wherever they would sit in the product's packages.
HARNESS = re.compile(r"(^|/)(bench\w*|kit|record|reference|soak\w*|synthetic\w*|tiny\w*|export_child)\.py$")
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def _harness_in(names: list[str]) -> list[str]:
    return [n for n in names if HARNESS.search(n) or n.startswith("tests/")]


def test_the_wheel_carries_no_benchmark(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "engine/cli/main.py" in names and "export/exporter.py" in names  # the product is there
    assert _harness_in(names) == []
    assert "deskfleet.benchmarks" not in entry_points and "bench" not in entry_points


def test_the_deb_carries_no_benchmark(wheel, tmp_path):
    root = tmp_path / "root"
    stage_package(root, project_version(), [wheel], "all")
    built = dpkg_build(root, tmp_path)
    listing = subprocess.run(["dpkg-deb", "-c", str(built)], capture_output=True, text=True, check=True).stdout
    files = [line.split()[-1].removeprefix(".") for line in listing.splitlines()]
    assert f"/opt/deskfleet/wheels/{wheel.name}" in files
    assert [f for f in files if HARNESS.search(f) or "bench" in f] == []
    unpacked = tmp_path / "unpacked"
    subprocess.run(["dpkg-deb", "-x", str(built), str(unpacked)], check=True)
    with zipfile.ZipFile(unpacked / "opt" / "deskfleet" / "wheels" / wheel.name) as z:
        assert _harness_in(z.namelist()) == []


def test_deskfleet_has_no_bench_command():
    done = subprocess.run([sys.executable, "-m", "engine.cli.main", "bench", "parity"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2 and "invalid choice: 'bench'" in done.stderr, done.stderr


def test_every_benchmark_module_is_on_the_command_line():
    commands = {p.stem for p in HERE.glob("*.py") if "\nCOMMAND = Command(" in p.read_text(encoding="utf-8")}
    assert commands == {m.rsplit(".", 1)[1] for m in BENCHMARKS.values()}
    for name, module in BENCHMARKS.items():
        assert importlib.import_module(module).COMMAND.name == name


def test_the_list_from_a_clone():
    done = subprocess.run([sys.executable, "-m", "tests.benchmarks", "--help"], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {PROG}")
    for name in BENCHMARKS:
        assert re.search(rf"^    {name}(\s|$)", done.stdout, re.MULTILINE), name


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_each_benchmark_answers_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    help_line = importlib.import_module(BENCHMARKS[name]).COMMAND.help
    assert out.startswith(f"usage: {PROG} {name}")
    assert " ".join(help_line.split()[:4]) in " ".join(out.split())
    assert "--json" in out  # where each one records


def test_no_benchmark_left_in_the_product():
    product = [p.relative_to(REPO).as_posix() for pkg in ("engine", "export", "agent", "console", "installer")
               for p in (REPO / pkg).rglob("*.py")]
    assert _harness_in(product) == []
