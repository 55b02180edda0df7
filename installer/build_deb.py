"""Build Deskfleet's Debian packages: ``python installer/build_deb.py [--out dist] [--export] [--no-vendor]``.

Writes ``deskfleet_<version>_<arch>.deb`` (agent + console, core dependencies + Qt, no torch)
and with ``--export`` also ``deskfleet-export_<version>_<arch>.deb`` (the admin's export
toolchain). By default every dependency's wheel is fetched now, through pip's configured index,
and shipped inside the package, so installing needs no network; ``--no-vendor`` ships only
Deskfleet's own wheel and lets the target's pip fetch the rest at install time. Needs
``dpkg-deb``. What the files say is in :mod:`installer.deb`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from installer import deb  # noqa: E402
from installer.packaging import (  # noqa: E402
    EXPORT_EXTRAS,
    REPO,
    STAGE_EXTRAS,
    BuildError,
    build_wheel,
    project_version,
    vendor_wheels,
)

ASSETS = REPO / "assets"
PNG_SIZES = (16, 32, 48, 64, 128, 256)
FLEET_UNIT = "deskfleet-fleet.service"


def _write(root: Path, path: str, content: str, mode: int) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content, encoding="utf-8")
    target.chmod(mode)


def _installed_kb(root: Path) -> int:
    total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and "DEBIAN" not in p.parts)
    return max(1, total // 1024)


def _control_dir(root: Path, scripts: dict[str, str], control: str, conffiles: tuple[str, ...] = ()) -> None:
    debian = root / "DEBIAN"
    debian.mkdir(parents=True, exist_ok=True)
    for name, text in scripts.items():
        _write(root, f"DEBIAN/{name}", text, 0o755)
    if conffiles:
        _write(root, "DEBIAN/conffiles", "".join(f"{c}\n" for c in conffiles), 0o644)
    _write(root, "DEBIAN/control", control, 0o644)


def _copy_wheels(wheels: list[Path], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        shutil.copy2(wheel, dest / wheel.name)
        (dest / wheel.name).chmod(0o644)


def stage_package(root: Path, version: str, wheels: list[Path], arch: str, assets: Path = ASSETS) -> None:
    """Lay out the ``deskfleet`` package's tree (with DEBIAN/) under ``root``."""
    for path, (content, mode) in deb.data_files(version).items():
        _write(root, path, content, mode)
    _copy_wheels(wheels, root / deb.PREFIX.lstrip("/") / "wheels")
    icons = root / "usr/share/icons/hicolor"
    for name in deb.ICON_NAMES:
        (icons / "scalable/apps").mkdir(parents=True, exist_ok=True)
        shutil.copy2(assets / f"{name}.svg", icons / "scalable/apps" / f"{name}.svg")
        for size in PNG_SIZES:
            (icons / f"{size}x{size}/apps").mkdir(parents=True, exist_ok=True)
            shutil.copy2(assets / f"{name}-{size}.png", icons / f"{size}x{size}/apps" / f"{name}.png")
    shutil.copy2(REPO / "README.md", root / "usr/share/doc/deskfleet/README.md")
    # the fleet service as a system unit (sudo systemctl enable --now deskfleet-fleet): off until enabled
    _write(root, f"/usr/lib/systemd/system/{FLEET_UNIT}", (REPO / "installer" / FLEET_UNIT).read_text(), 0o644)
    _control_dir(root, {"config": deb.config_script(), "postinst": deb.postinst(), "prerm": deb.prerm(),
                        "postrm": deb.postrm()},
                 deb.control(version, arch, _installed_kb(root)), deb.CONFFILES)
    _write(root, "DEBIAN/templates", deb.templates(), 0o644)  # the silent install's debconf questions


def stage_export_package(root: Path, version: str, wheels: list[Path], arch: str) -> None:
    """Lay out the ``deskfleet-export`` package: the export toolchain's wheels and scripts."""
    _copy_wheels(wheels, root / deb.EXPORT_WHEELS.lstrip("/"))
    _write(root, "usr/share/doc/deskfleet-export/copyright", deb.copyright_file(), 0o644)
    _control_dir(root, {"postinst": deb.export_postinst(), "postrm": deb.export_postrm()},
                 deb.export_control(version, arch, _installed_kb(root)))


def dpkg_build(root: Path, out_dir: Path) -> Path:
    """``dpkg-deb --build`` the staged ``root`` into ``out_dir``; returns the .deb."""
    if shutil.which("dpkg-deb") is None:
        raise BuildError("dpkg-deb is not installed (Debian/Ubuntu: apt-get install dpkg-dev)")
    fields = dict(line.split(": ", 1) for line in (root / "DEBIAN/control").read_text().splitlines()
                  if ": " in line and not line.startswith(" "))
    out = out_dir / f"{fields['Package']}_{fields['Version']}_{fields['Architecture']}.deb"
    # The wheels inside are zip files already: fast gzip, not xz, which would gain ~nothing in minutes.
    proc = subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-z1", "--build", str(root), str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"dpkg-deb failed: {proc.stderr.strip()}")
    return out


def _arch(vendored: bool) -> str:
    if not vendored:
        return "all"  # pure-Python wheel only; the target's pip fetches the native dependencies
    return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()


def build(out_dir: Path, *, vendor: bool = True, export: bool = False, work: Path | None = None) -> list[Path]:
    """Build the package(s) into ``out_dir``; ``work`` keeps downloaded wheels between builds."""
    out_dir.mkdir(parents=True, exist_ok=True)
    work = work or out_dir / "work"
    version = project_version()
    core_dir = work / "wheels"
    for old in core_dir.glob("deskfleet-*.whl"):  # always this tree's own, never a stale build
        old.unlink()
    wheel = build_wheel(core_dir)
    wheels = vendor_wheels(wheel, STAGE_EXTRAS, core_dir) if vendor else [wheel]
    arch = _arch(vendor)
    root = work / "root-deskfleet"
    shutil.rmtree(root, ignore_errors=True)
    stage_package(root, version, wheels, arch)
    built = [dpkg_build(root, out_dir)]
    if export:
        export_dir = work / "export-wheels"
        everything = vendor_wheels(wheel, EXPORT_EXTRAS, export_dir)
        have = {w.name for w in wheels}
        extra = [w for w in everything if w.name not in have]
        root = work / "root-deskfleet-export"
        shutil.rmtree(root, ignore_errors=True)
        stage_export_package(root, version, extra, arch)
        built.append(dpkg_build(root, out_dir))
    return built


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "dist", help="where the .deb files go (default dist/)")
    p.add_argument("--work", type=Path, default=None, help="build directory, reused between builds (default OUT/work)")
    p.add_argument("--no-vendor", action="store_true",
                   help="ship only Deskfleet's wheel; the target fetches the dependencies when installing")
    p.add_argument("--export", action="store_true", help="also build deskfleet-export (torch etc., admin only)")
    args = p.parse_args(argv)
    try:
        for path in build(args.out, vendor=not args.no_vendor, export=args.export, work=args.work):
            print(f"{path} ({os.path.getsize(path) / 2**20:.0f} MB)")
    except BuildError as exc:
        print(f"build_deb: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
