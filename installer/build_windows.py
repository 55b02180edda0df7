"""Build Deskfleet's Windows installer: ``python installer/build_windows.py [--out dist/windows]``.

Steps 1-3 run on any OS; step 4 needs Windows with Inno Setup 6 (``iscc`` on PATH or in its
default folder):

1. Deskfleet's wheel, from this tree;
2. every dependency of ``deskfleet[gui]`` as ``win_amd64`` wheels for ``--python-version``
   (default 3.11), through pip's configured index (``--no-vendor``: Deskfleet's wheel only; the
   target then fetches the rest while installing);
3. ``deskfleet.iss``, ``install-venv.ps1`` and the icons (:mod:`installer.windows`);
4. ``iscc deskfleet.iss`` -> ``Output/deskfleet-setup-<version>.exe``.

Elsewhere it stops after step 3 and says how to finish on a Windows machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from installer import windows  # noqa: E402
from installer.packaging import (  # noqa: E402
    REPO,
    STAGE_EXTRAS,
    BuildError,
    build_wheel,
    project_version,
    vendor_wheels,
)

ISCC_DEFAULT = Path(os.environ.get("ProgramFiles(x86)", r"C:\Program Files (x86)")) / "Inno Setup 6" / "ISCC.exe"


def stage(out: Path, *, vendor: bool = True, python_version: str = "3.11") -> Path:
    """Write everything ``iscc`` needs into ``out``; returns the .iss path."""
    version = project_version()
    wheels = out / "wheels"
    for old in wheels.glob("deskfleet-*.whl"):
        old.unlink()
    wheel = build_wheel(wheels)
    if vendor:
        vendor_wheels(wheel, STAGE_EXTRAS, wheels, platform="win_amd64", python_version=python_version)
    for name in ("deskfleet-agent.ico", "deskfleet-console.ico"):
        shutil.copy2(REPO / "assets" / name, out / name)
    (out / "install-venv.ps1").write_text(windows.install_venv_ps1(version), encoding="utf-8-sig")
    iss = out / "deskfleet.iss"
    iss.write_text(windows.inno_script(version), encoding="utf-8-sig")  # Inno reads UTF-8 with a BOM
    return iss


def find_iscc() -> str | None:
    found = shutil.which("iscc") or shutil.which("ISCC")
    if found:
        return found
    return str(ISCC_DEFAULT) if ISCC_DEFAULT.is_file() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "dist" / "windows")
    p.add_argument("--python-version", default="3.11", help="the target Python the bundled wheels fit")
    p.add_argument("--no-vendor", action="store_true", help="bundle Deskfleet's wheel only")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        iss = stage(args.out, vendor=not args.no_vendor, python_version=args.python_version)
    except BuildError as exc:
        print(f"build_windows: {exc}", file=sys.stderr)
        return 1
    iscc = find_iscc()
    if iscc is None:
        print(f"build_windows: staged {args.out}. To finish, copy it to a Windows PC with Inno Setup 6 and run:\n"
              f"  iscc {iss.name}\n(the installer appears in Output\\)")
        return 0
    proc = subprocess.run([iscc, str(iss)], cwd=args.out)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
