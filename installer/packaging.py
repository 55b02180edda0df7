"""Steps every platform's package build shares: Deskfleet's own wheel, and the wheels of its
dependencies fetched once at build time so that installing needs no network.

The wheel is built from a copy of the source (the work tree stays untouched by ``build/`` and
``*.egg-info``). Dependencies come through pip with the build machine's own configuration (its
index or mirror), binary wheels only: an install must never compile anything on a stage PC.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "export", "agent", "console", "installer")
# What a stage PC gets: the core (openvino, numpy, ...) and the Qt tray/console. The admin's
# package adds the (torch-free) export extra; the NPU target's torch toolchain is in neither.
STAGE_EXTRAS = ("gui",)
EXPORT_EXTRAS = ("gui", "export")
FORBIDDEN_ON_STAGE_PCS = ("torch", "transformers", "nncf", "optimum", "accelerate")


class BuildError(RuntimeError):
    """A packaging step failed; the message names the step and the tool's last words."""


def project_version(repo: Path = REPO) -> str:
    with open(repo / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def requirement(version: str, extras: Sequence[str]) -> str:
    """``deskfleet[gui]==0.1.0``: what an installer asks pip for."""
    return f"deskfleet[{','.join(extras)}]=={version}" if extras else f"deskfleet=={version}"


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise BuildError(f"{what} failed ({' '.join(cmd[:6])} ...):\n" + "\n".join(tail))


def build_wheel(out_dir: Path, repo: Path = REPO) -> Path:
    """Build ``deskfleet-<version>-py3-none-any.whl`` into ``out_dir`` from a copy of the sources."""
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = out_dir / ".wheel-src"
    shutil.rmtree(staging, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for package in PACKAGES:
        shutil.copytree(repo / package, staging / package, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(repo / name, staging / name)
    try:
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
              "-q", "-w", str(out_dir), str(staging)], "building the deskfleet wheel")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    wheel = out_dir / f"deskfleet-{project_version(repo)}-py3-none-any.whl"
    if not wheel.is_file():
        raise BuildError(f"pip built no {wheel.name} in {out_dir}")
    return wheel


def vendor_wheels(wheel: Path, extras: Sequence[str], dest: Path, *, platform: str | None = None,
                  python_version: str | None = None) -> list[Path]:
    """Download ``wheel`` plus every dependency of ``extras`` as binary wheels into ``dest``.

    ``platform``/``python_version`` fetch for another target (e.g. ``win_amd64``, ``3.11``);
    by default the wheels fit this interpreter and machine.
    """
    dest.mkdir(parents=True, exist_ok=True)
    version = wheel.name.split("-")[1]
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--only-binary=:all:",
           "--dest", str(dest), "--find-links", str(wheel.parent)]
    if platform:
        cmd += ["--platform", platform]
    if python_version:
        cmd += ["--python-version", python_version]
    _run([*cmd, requirement(version, extras)], f"downloading the dependencies of deskfleet[{','.join(extras)}]")
    wheels = sorted(dest.glob("*.whl"))
    if extras == STAGE_EXTRAS or "export" not in extras:
        bad = [w.name for w in wheels if w.name.split("-")[0].lower() in FORBIDDEN_ON_STAGE_PCS]
        if bad:
            raise BuildError(f"the stage-PC bundle would carry {', '.join(bad)}; a core dependency pulls the "
                             "export toolchain in: fix pyproject.toml before packaging")
    return wheels
