"""Packaging: the files the Debian packages and the Windows installer carry (read back by
independent parsers), the icons, and (slow) the real .deb built, unpacked into a temporary root,
its environment built offline from the bundled wheels into a fresh venv (the machine's own Python
untouched), no torch in it, and the headless agent started from it."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from configparser import ConfigParser
from pathlib import Path

import pytest

from agent.tray import autostart
from installer import deb, windows
from installer.build_deb import build, dpkg_build, stage_export_package
from installer.build_windows import stage as stage_windows
from installer.packaging import FORBIDDEN_ON_STAGE_PCS, REPO, project_version, requirement

VERSION = project_version()


def _ini(text: str) -> ConfigParser:
    parser = ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str
    parser.read_string(text)
    return parser


def _sh_syntax_ok(script: str, tmp_path: Path) -> None:
    path = tmp_path / "script.sh"
    path.write_text(script)
    proc = subprocess.run(["sh", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_desktop_entries_unit_and_scripts(tmp_path):
    files = deb.data_files(VERSION)
    for name, args in (("agent", ["agent"]), ("console", ["console"])):
        entry = _ini(files[f"/usr/share/applications/deskfleet-{name}.desktop"][0])["Desktop Entry"]
        assert shlex.split(entry["Exec"]) == [deb.BIN, *args]
        assert entry["Icon"] == f"deskfleet-{name}" and entry["Type"] == "Application"
    auto = _ini(files["/etc/xdg/autostart/deskfleet-agent.desktop"][0])["Desktop Entry"]
    assert shlex.split(auto["Exec"]) == [deb.BIN, "agent"] and "Hidden" not in auto
    assert deb.CONFFILES == ("/etc/xdg/autostart/" + autostart.DESKTOP_FILE,)

    unit = _ini(files["/usr/lib/systemd/user/deskfleet-agent.service"][0])
    assert shlex.split(unit["Service"]["ExecStart"]) == [deb.BIN, "agent", "--headless"]
    assert unit["Install"]["WantedBy"] == "default.target" and unit["Service"]["Restart"] == "on-failure"

    script = files["/opt/deskfleet/lib/install-venv.sh"][0]
    assert requirement(VERSION, ("gui",)).replace("gui", "$extras") in script
    assert "--no-index" in script and "export" not in script.split("if [ -d")[0]
    assert files[deb.BIN][0].endswith('exec /opt/deskfleet/venv/bin/deskfleet "$@"\n')
    for text in (script, files[deb.BIN][0], deb.postinst(), deb.prerm(), deb.export_postinst(), deb.export_postrm()):
        _sh_syntax_ok(text, tmp_path)
    assert "/opt/deskfleet/lib/install-venv.sh /opt/deskfleet" in deb.postinst()
    assert "rm -rf /opt/deskfleet/venv" in deb.prerm()


def _debconf_stanzas(text: str) -> dict[str, dict[str, str]]:
    """A templates file as {Template: {field: first line}}, parsed as debconf reads it (RFC 822 stanzas)."""
    out = {}
    for stanza in text.strip().split("\n\n"):
        fields = {}
        for line in stanza.splitlines():
            if not line.startswith(" "):
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        out[fields["Template"]] = fields
    return out


def test_the_silent_install_files(tmp_path):
    questions = _debconf_stanzas(deb.templates())
    assert questions[deb.DEBCONF_TOKEN]["Type"] == "password"  # never echoed, kept with the passwords
    assert questions[deb.DEBCONF_CONSOLE]["Type"] == "string" and questions[deb.DEBCONF_CONSOLE]["Default"] == ""
    assert all(q["Description"] for q in questions.values())
    assert "debconf (>= 0.5) | debconf-2.0" in deb.control(VERSION, "all", 1)
    for text in (deb.config_script(), deb.postinst(), deb.prerm(), deb.postrm(), deb.write_token_script()):
        _sh_syntax_ok(text, tmp_path)
    assert f"db_input high {deb.DEBCONF_TOKEN}" in deb.config_script()
    post = deb.postinst()
    assert post.index(". /usr/share/debconf/confmodule") < post.index("install-venv.sh")  # before any output
    assert f'"$token" | {deb.WRITE_TOKEN} {deb.JOIN_FILE}' in post  # on stdin (printf is built in), not an argument
    assert f"systemctl restart {deb.SYSTEM_UNIT_NAME}" in post and "db_stop" in post
    assert f"rm -f {deb.JOIN_FILE}" in deb.postrm() and "db_purge" in deb.postrm()

    unit = _ini(deb.data_files(VERSION)[f"/usr/lib/systemd/system/{deb.SYSTEM_UNIT_NAME}"][0])
    assert shlex.split(unit["Service"]["ExecStart"]) == [deb.BIN, "agent", "--headless", "--state-dir",
                                                          deb.SYSTEM_STATE, "--join-file", deb.STATE_JOIN_FILE]
    assert unit["Service"]["User"] == unit["Service"]["Group"] == deb.AGENT_USER != "root"
    assert "ReadWritePaths" not in unit["Service"] and unit["Service"]["NoNewPrivileges"] == "yes"
    assert unit["Service"]["ProtectSystem"] == "strict"
    assert "adduser --system --group" in post and deb.HANDOVER in post and 'chown "$user:" "$tmp"' not in post
    assert unit["Install"]["WantedBy"] == "multi-user.target"

    root = tmp_path / "root"
    from installer.build_deb import stage_package

    stage_package(root, VERSION, [], "all")
    for name, mode in (("templates", 0o644), ("config", 0o755), ("postinst", 0o755), ("postrm", 0o755)):
        assert (root / "DEBIAN" / name).stat().st_mode & 0o777 == mode, name
    assert (root / "DEBIAN/templates").read_text() == deb.templates()
    assert (root / deb.WRITE_TOKEN.lstrip("/")).stat().st_mode & 0o777 == 0o755
    if shutil.which("dpkg-deb") is not None:  # dpkg-deb checks the control members' modes itself
        info = subprocess.run(["dpkg-deb", "--info", str(dpkg_build(root, tmp_path))], capture_output=True,
                              text=True, check=True).stdout
        assert all(f" {name}" in info for name in ("config", "templates", "postinst", "postrm", "prerm")), info
    if shutil.which("systemd-analyze") is not None:
        exe = shutil.which("deskfleet") or sys.executable
        local = tmp_path / deb.SYSTEM_UNIT_NAME
        local.write_text(deb.systemd_system_unit().replace(deb.BIN, exe))
        proc = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr


def test_the_agent_system_unit_is_hardened(tmp_path):
    """Issue 29, L13: the agent's system service runs models from the network, so its unit takes away what
    a compromised worker could use: no capability, the ordinary syscalls only, IP/unix/netlink sockets
    only, no kernel log, and a memory and task bound for the agent and its workers together."""
    service = _ini(deb.systemd_system_unit())["Service"]
    assert service["CapabilityBoundingSet"] == "" and service["AmbientCapabilities"] == ""
    assert service["SystemCallFilter"] == "@system-service" and service["SystemCallErrorNumber"] == "EPERM"
    assert set(service["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    assert service["ProtectKernelLogs"] == service["NoNewPrivileges"] == service["RestrictNamespaces"] == "yes"
    assert service["MemoryMax"] == deb.AGENT_MEMORY_MAX and 0 < int(deb.AGENT_MEMORY_MAX.rstrip("%")) < 100
    assert 0 < int(service["TasksMax"]) <= 4096
    if shutil.which("systemd-analyze") is not None:
        exe = shutil.which("deskfleet") or sys.executable
        local = tmp_path / deb.SYSTEM_UNIT_NAME
        local.write_text(deb.systemd_system_unit().replace(deb.BIN, exe))
        proc = subprocess.run(["systemd-analyze", "verify", str(local)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "Unknown" not in proc.stderr, proc.stderr


@pytest.mark.skipif(os.name != "posix", reason="runs the .deb's shell script")
def test_the_token_is_written_root_only_and_what_is_not_a_token_is_refused(tmp_path):
    script = tmp_path / "write-join-token.sh"
    script.write_text(deb.write_token_script())
    target = tmp_path / "etc" / "deskfleet" / "join-token"

    def write(token: str, console: str = "") -> subprocess.CompletedProcess:
        return subprocess.run(["sh", str(script), str(target), console], input=token, capture_output=True,
                              text=True, timeout=30)

    assert write("  DFJ1-abc-def-ghij \n", "10.0.0.5:7411").returncode == 0
    assert target.read_text() == "DFJ1-abc-def-ghij\nconsole=10.0.0.5:7411\n"
    assert target.stat().st_mode & 0o777 == 0o600
    assert not [p for p in target.parent.iterdir() if p.name != "join-token"]  # no temporary file left
    for token, console, words in (("hello\n", "", "not one"), ("DFJ1-a-b-c\n", "no-port", "host:port"),
                                  ("DFJ1-a-b-c\n", "a b:1", "host:port"), ("DFJ1-a-b-c\n", "h:7x", "host:port")):
        proc = write(token, console)
        assert proc.returncode == 2 and words in proc.stderr, (token, console, proc.stderr)
        assert target.read_text() == "DFJ1-abc-def-ghij\nconsole=10.0.0.5:7411\n"  # the old file untouched


@pytest.mark.skipif(shutil.which("debconf-set-selections") is None
                    or not Path("/usr/share/debconf/confmodule").exists(), reason="debconf is not installed here")
def test_postinst_takes_the_preseeded_debconf_password_into_the_root_only_file(tmp_path, request):
    """The real postinst under the real debconf (its own database in tmp_path, nothing of this
    machine's touched): the pre-seeded token lands in the file, 0600, and is cleared from debconf.
    The script's system paths are pointed into tmp_path (the venv build skipped, no systemd)."""
    db = tmp_path / "debconf"
    db.mkdir()
    (db / "debconf.conf").write_text(f"Config: configdb\nTemplates: templatedb\n\nName: configdb\nDriver: File\n"
                                     f"Filename: {db}/config.dat\n\nName: templatedb\nDriver: File\nMode: 644\n"
                                     f"Filename: {db}/templates.dat\n")
    join_file, writer = tmp_path / "etc" / "join-token", tmp_path / "write-join-token.sh"
    # as root the hand-over writes as the agent's user (here: nobody), who must reach the state dir's
    # parent as it reaches /var/lib: a world-traversable sandbox, not pytest's root-only tmp_path
    sandbox = Path(tempfile.mkdtemp(prefix="deskfleet-postinst-"))
    sandbox.chmod(0o755)
    request.addfinalizer(lambda: shutil.rmtree(sandbox))
    state = sandbox / "state"
    copy = state / "join-token"
    writer.write_text(deb.write_token_script())
    writer.chmod(0o755)
    script = (deb.postinst().replace(deb.JOIN_FILE, str(join_file)).replace(deb.WRITE_TOKEN, str(writer))
              .replace(f"{deb.PREFIX}/lib/install-venv.sh {deb.PREFIX}", "true")
              .replace("/run/systemd/system", str(tmp_path / "no-systemd"))
              .replace(f"user={deb.AGENT_USER}", "user=nobody").replace(f"state={deb.SYSTEM_STATE}", f"state={state}"))
    postinst = db / "deskfleet.postinst"  # debconf loads deskfleet.templates beside it
    postinst.write_text(script)
    postinst.chmod(0o755)
    (db / "deskfleet.templates").write_text(deb.templates())
    env = {"PATH": os.environ["PATH"], "DEBCONF_SYSTEMRC": str(db / "debconf.conf"),
           "DEBIAN_FRONTEND": "noninteractive"}
    token = "DFJ1-" + "a" * 32 + "-" + "B" * 26 + "-CCCC"
    selections = (f"deskfleet {deb.DEBCONF_TOKEN} password {token}\n"
                  f"deskfleet {deb.DEBCONF_CONSOLE} string 10.0.0.5:7411\n")
    subprocess.run(["debconf-set-selections"], input=selections, text=True, env=env, check=True, timeout=60)
    proc = subprocess.run([str(postinst), "configure"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert copy.read_text() == f"{token}\nconsole=10.0.0.5:7411\n" and not join_file.exists()
    assert copy.stat().st_mode & 0o777 == 0o600 and state.stat().st_mode & 0o777 == 0o700
    if os.geteuid() == 0:  # the agent user's (here: nobody's), not root's
        assert copy.stat().st_uid == state.stat().st_uid == 65534
    assert not [p for p in state.iterdir() if p.name != "join-token"]
    stored = (db / "config.dat").read_text()
    assert token not in stored and "deskfleet/join-token" in stored  # the file keeps it; debconf does not
    # an admin's own file (any mode) is kept and made root's 0600 when no token was pre-seeded
    join_file.parent.mkdir(exist_ok=True)
    join_file.write_text("DFJ1-placed-by-admin\n")
    join_file.chmod(0o644)
    proc = subprocess.run([str(postinst), "configure"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert copy.read_text() == "DFJ1-placed-by-admin\n" and copy.stat().st_mode & 0o777 == 0o600
    assert not join_file.exists()


_STUB_PYTHON = """#!/bin/sh
# A Python whose pip finds nothing: logs every call, makes "venv" a copy of itself.
echo "$*" >> "$STUB_LOG"
if [ "$2" = "-m" ] && [ "$3" = "venv" ]; then mkdir -p "$4/bin" && cp "$0" "$4/bin/python"; exit 0; fi
if [ "$1" = "-V" ]; then echo "Python 3.99.0"; exit 0; fi
exit 1
"""


@pytest.mark.skipif(os.name != "posix", reason="runs the .deb's shell script")
def test_install_venv_fails_closed_when_the_bundled_wheels_do_not_fit(tmp_path):
    stub, log, prefix = tmp_path / "python3", tmp_path / "calls.log", tmp_path / "opt"
    stub.write_text(_STUB_PYTHON)
    stub.chmod(0o755)
    (prefix / "wheels").mkdir(parents=True)
    script = tmp_path / "install-venv.sh"
    script.write_text(deb.install_venv_script(VERSION))
    proc = subprocess.run(["sh", str(script), str(prefix)], env={"PATH": os.environ["PATH"], "PYTHON": str(stub),
                          "STUB_LOG": str(log)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "nothing was installed from the network" in proc.stderr
    calls = log.read_text().splitlines()
    installs = [c for c in calls if " pip " in f" {c} " and "install" in c]
    assert installs and all("--no-index" in c for c in installs), calls  # never the package index
    assert calls[0].startswith("-I -m venv") and all(c.startswith("-I") for c in installs)
    assert not (prefix / "venv").exists()  # no half-built environment left behind


def test_the_trays_start_at_login_toggle_masks_the_packages_autostart_entry(tmp_path):
    system = tmp_path / "etc-xdg"
    (system / "autostart").mkdir(parents=True)
    (system / "autostart" / autostart.DESKTOP_FILE).write_text(deb.autostart_entry())
    kw = dict(platform="linux", home=tmp_path / "home",
              env={"XDG_CONFIG_HOME": str(tmp_path / "cfg"), "XDG_CONFIG_DIRS": f"/nonexistent:{system}"})
    assert autostart.is_enabled(**kw)  # installed: on for everyone
    assert autostart.disable(**kw) is True  # the person turns it off ...
    assert not autostart.is_enabled(**kw)
    mask = _ini((tmp_path / "cfg" / "autostart" / autostart.DESKTOP_FILE).read_text())["Desktop Entry"]
    assert mask["Hidden"] == "true"
    assert (system / "autostart" / autostart.DESKTOP_FILE).is_file()  # ... without touching the package's
    assert autostart.disable(**kw) is False
    autostart.enable([deb.BIN, "agent"], **kw)
    assert autostart.is_enabled(**kw)


def test_the_export_package_depends_on_the_core_and_carries_no_core_files(tmp_path):
    root = tmp_path / "root"
    stage_export_package(root, VERSION, [], "all")
    built = dpkg_build(root, tmp_path)
    info = subprocess.run(["dpkg-deb", "--field", str(built), "Package", "Depends"], capture_output=True,
                          text=True, check=True).stdout
    assert "Package: deskfleet-export" in info and f"Depends: deskfleet (= {VERSION})" in info
    listing = subprocess.run(["dpkg-deb", "-c", str(built)], capture_output=True, text=True, check=True).stdout
    assert "./opt/deskfleet/export-wheels/" in listing and "/usr/bin/" not in listing
    assert "gui,export" in deb.install_venv_script(VERSION)  # the core script adds the extra when present


def test_windows_installer_files(tmp_path):
    iss = windows.inno_script(VERSION)
    assert "PrivilegesRequired=lowest" in iss and f"AppVersion={VERSION}" in iss
    reg = next(line for line in iss.splitlines() if line.startswith("Root: HKCU"))
    assert f'Subkey: "{autostart.RUN_KEY}"' in reg and f'ValueName: "{autostart.RUN_VALUE_NAME}"' in reg
    value = reg.split("ValueData: ", 1)[1].split("; Flags", 1)[0]
    assert value[0] == value[-1] == '"'
    app = r"C:\Users\Ana Lopez\AppData\Local\Programs\Deskfleet"
    written = value[1:-1].replace('""', '"').replace("{app}", app)
    # exactly what the tray's own "Start at login" writes, so the tray sees the installer's choice
    pythonw = app + r"\venv\Scripts\pythonw.exe"
    assert written == autostart.windows_run_value([pythonw, "-m", "engine.cli.main", "agent"])
    for shortcut, args in (("Deskfleet agent", "agent"), ("Deskfleet console", "console")):
        line = next(x for x in iss.splitlines() if f"\\{shortcut}\"" in x)
        assert windows.PYTHONW in line and f'Parameters: "-m engine.cli.main {args}"' in line
    silent = next(x for x in iss.splitlines() if "Check: JoinTokenGiven" in x)
    assert "skipifnotsilent" in silent and windows.PYTHONW in silent  # a silent install with a token starts the agent
    code = iss.split("[Code]", 1)[1]
    for needle in ("{param:TOKEN|}", "{param:TOKENFILE|}", "{param:CONSOLE|}", "/inheritance:r",
                   "*S-1-5-18:F", "*S-1-5-32-544:F", r"{localappdata}\Deskfleet\agent", r"'\join-token'"):
        assert needle in code, needle
    # the ACL is narrowed while the file is still empty, the token written after
    assert code.index("SaveStringToFile(Target, '', False)") < code.index("icacls") < code.index(
        "SaveStringToFile(Target, Text, False)")
    ps1 = windows.install_venv_ps1(VERSION)
    assert f'"deskfleet[gui]=={VERSION}"' in ps1 and "--no-index" in ps1 and "export" not in ps1

    out = tmp_path / "win"
    out.mkdir()
    iss_path = stage_windows(out, vendor=False)
    assert iss_path.read_bytes().startswith(b"\xef\xbb\xbf")
    names = {p.name for p in out.iterdir()} | {p.name for p in (out / "wheels").iterdir()}
    assert {"deskfleet.iss", "install-venv.ps1", "deskfleet-agent.ico", "deskfleet-console.ico",
            f"deskfleet-{VERSION}-py3-none-any.whl"} <= names


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def test_icons_exist_in_every_size():
    for name in deb.ICON_NAMES:
        assert ET.parse(REPO / "assets" / f"{name}.svg").getroot().tag.endswith("svg")
        for size in (16, 32, 48, 64, 128, 256):
            assert _png_size(REPO / "assets" / f"{name}-{size}.png") == (size, size)
        assert (REPO / "assets" / f"{name}.ico").read_bytes()[:4] == b"\x00\x00\x01\x00"  # ICO header


def _work_dir() -> Path:
    cache = Path(os.environ.get("DESKFLEET_CACHE", Path.home() / ".cache" / "deskfleet"))
    return cache / "installer-work"  # downloaded wheels are kept between runs


@pytest.mark.slow
def test_the_deb_installs_offline_without_torch_and_runs_the_headless_agent(tmp_path):
    (deb_path,) = build(tmp_path / "dist", work=_work_dir())
    fields = subprocess.run(["dpkg-deb", "--field", str(deb_path), "Package", "Depends"], capture_output=True,
                            text=True, check=True).stdout
    assert "Package: deskfleet\n" in fields and "python3-venv" in fields
    listing = subprocess.run(["dpkg-deb", "-c", str(deb_path)], capture_output=True, text=True, check=True).stdout
    for path in ("./usr/bin/deskfleet", "./etc/xdg/autostart/deskfleet-agent.desktop",
                 "./usr/lib/systemd/user/deskfleet-agent.service", "./usr/share/applications/deskfleet-console.desktop",
                 "./usr/share/icons/hicolor/scalable/apps/deskfleet-agent.svg",
                 f"./opt/deskfleet/wheels/deskfleet-{VERSION}-py3-none-any.whl"):
        assert path in listing, path
    bundled = [line.rsplit("/", 1)[1].split("-")[0].lower() for line in listing.splitlines() if line.endswith(".whl")]
    assert "openvino" in bundled and "pyside6_essentials" in bundled
    assert not set(bundled) & set(FORBIDDEN_ON_STAGE_PCS)

    root = tmp_path / "root"
    subprocess.run(["dpkg", "-x", str(deb_path), str(root)], check=True)
    prefix = root / "opt" / "deskfleet"
    # No pip configuration (no mirror, no find-links) and --no-index in the script: only the bundle counts.
    env = {**os.environ, "PYTHON": sys.executable, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1"}
    proc = subprocess.run(["sh", str(prefix / "lib" / "install-venv.sh"), str(prefix)], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "do not fit this Python" not in proc.stderr  # the offline path, not the index fallback
    python = prefix / "venv" / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import importlib.util as u, sys; "
                            "print(sys.prefix); print(u.find_spec('engine').origin); "
                            "print([m for m in ('torch', 'transformers', 'nncf', 'PySide6', "
                            "'openvino', 'engine', 'agent') if u.find_spec(m)])"],
                           capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]},
                           cwd=tmp_path)
    prefix_line, engine_origin, found = probe.stdout.splitlines()
    assert Path(prefix_line) == prefix / "venv"
    assert Path(engine_origin).is_relative_to(prefix / "venv")  # the packaged code, not this checkout
    assert eval(found) == ["PySide6", "openvino", "engine", "agent"]  # and no torch, transformers or nncf

    agent_env = {**os.environ, "DESKFLEET_KEYRING_DIR": str(tmp_path / "keyring")}
    agent = subprocess.Popen([str(prefix / "venv" / "bin" / "deskfleet"), "agent", "--headless", "--interface",
                              "127.0.0.1", "--state-dir", str(tmp_path / "state"), "--control-port", "0",
                              "--data-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=agent_env, cwd=tmp_path)
    lines = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = agent.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "deskfleet agent: not-joined" in line:
                break
        assert any("deskfleet agent: not-joined" in x for x in lines), "".join(lines)
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0
