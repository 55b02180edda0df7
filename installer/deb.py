"""What goes into Deskfleet's Debian packages, as text: pure functions, tested without dpkg.

Two packages, so that a stage PC can never get torch by accident:

- ``deskfleet``: the agent (tray and headless) and the console on the core dependencies plus
  Qt. Its wheels (Deskfleet's and every dependency's) ship inside the package under
  ``/opt/deskfleet/wheels``; ``postinst`` builds ``/opt/deskfleet/venv`` from them with no
  network. Should the bundled wheels not fit the target's Python (another minor version), the
  script fails closed (see :func:`install_venv_script`).
- ``deskfleet-export``: the export toolchain for the admin's machine (the safetensors and GGUF
  readers; the stage builder itself needs nothing else), installed on top into the same
  environment. Optional; depends on ``deskfleet``. Every target, the NPU's included, is built
  without torch.

Layout: ``/usr/bin/deskfleet`` (a wrapper into the venv), desktop entries and hicolor icons for
the tray agent and the console, an XDG autostart entry for the tray (same file name as the
per-user one :mod:`agent.tray.autostart` writes, so the tray's "Start at login" can override it),
and a systemd *user* unit for the headless agent (``systemctl --user enable --now
deskfleet-agent``).

Silent install (a software-distribution tool rolling the agent out): a debconf question of type
``password``, ``deskfleet/join-token`` (and ``deskfleet/console``, the enrolment address, empty:
found over mDNS), pre-seeded with ``debconf-set-selections`` before ``apt-get install``, or the root-only file
``/etc/deskfleet/join-token`` an admin (or the distribution tool) places before installing.
postinst (root) creates the system user ``deskfleet-agent`` (idempotent; added to the ``render``
and ``video`` groups where they exist, for the iGPU's and NPU's device nodes), makes its state dir
``/var/lib/deskfleet-agent`` its own (0700), and hands the token over into that dir as the agent
user's 0600 ``join-token`` (written atomically *by that user* through ``setpriv``, the token on stdin,
never in argv: root never creates, chowns or renames a path in a directory the agent's user can change,
where a swapped-in symlink would hand that user a file of root's); the /etc copy
is removed and debconf's answer cleared. It then enables the *system* unit
``deskfleet-agent-system.service``: the headless agent as ``deskfleet-agent`` (never root), which
joins with its copy at start and deletes it (:mod:`agent.service.join_file`). Re-running postinst
(an upgrade, ``dpkg-reconfigure`` with a new token) hands the new token over the same way and
restarts the unit.
"""

from __future__ import annotations

from agent.tray.autostart import DESKTOP_FILE, desktop_entry

PREFIX = "/opt/deskfleet"
BIN = "/usr/bin/deskfleet"
UNIT_NAME = "deskfleet-agent.service"
MAINTAINER = "Deskfleet maintainers <maintainers@deskfleet.invalid>"
ICON_NAMES = ("deskfleet-agent", "deskfleet-console")
EXPORT_WHEELS = f"{PREFIX}/export-wheels"
JOIN_FILE = "/etc/deskfleet/join-token"
SYSTEM_UNIT_NAME = "deskfleet-agent-system.service"
SYSTEM_STATE = "/var/lib/deskfleet-agent"
AGENT_USER = "deskfleet-agent"  # the system agent's user and group (postinst creates them)
STATE_JOIN_FILE = f"{SYSTEM_STATE}/join-token"  # the agent user's own copy of the token
WRITE_TOKEN = f"{PREFIX}/lib/write-join-token.sh"
DEBCONF_TOKEN = "deskfleet/join-token"
DEBCONF_CONSOLE = "deskfleet/console"
AGENT_MEMORY_MAX = "75%"  # of the PC's RAM: the agent, its stage workers and their KV pools, never the whole PC
AGENT_TASKS_MAX = 1024  # OpenVINO's threads per worker, a worker and its spare, the agent's own


def control(version: str, arch: str, installed_kb: int) -> str:
    return (f"Package: deskfleet\nVersion: {version}\nArchitecture: {arch}\nMaintainer: {MAINTAINER}\n"
            f"Installed-Size: {installed_kb}\nSection: net\nPriority: optional\n"
            "Depends: python3 (>= 3.11), python3-venv, debconf (>= 0.5) | debconf-2.0\n"
            "Recommends: libxcb-cursor0, libxkbcommon-x11-0, libegl1\n"
            "Homepage: https://deskfleet.invalid\n"
            "Description: lend idle office PCs to an LLM inference fleet\n"
            " The Deskfleet agent (tray icon, or headless) lends this PC's CPU, GPU and NPU\n"
            " to the organisation's LLM fleet while nobody uses it, and steps aside at once\n"
            " when someone does. Also contains the admin console. No torch: the export\n"
            " toolchain is the separate package deskfleet-export.\n")


def export_control(version: str, arch: str, installed_kb: int) -> str:
    return (f"Package: deskfleet-export\nVersion: {version}\nArchitecture: {arch}\nMaintainer: {MAINTAINER}\n"
            f"Installed-Size: {installed_kb}\nSection: net\nPriority: optional\n"
            f"Depends: deskfleet (= {version})\n"
            "Description: Deskfleet's model export toolchain (for the admin's machine)\n"
            " Adds the safetensors and GGUF readers to Deskfleet's environment, so the console\n"
            " can turn checkpoints into per-stage OpenVINO shards (no torch). Stage PCs do not\n"
            " need it.\n")


def install_venv_script(version: str) -> str:
    """``install-venv.sh [PREFIX]``: (re)build PREFIX/venv from PREFIX/wheels (and the export
    wheels when deskfleet-export is installed). ``PYTHON`` chooses the interpreter (default
    ``python3``).

    Offline only, and it fails closed: postinst runs it as root, and a fallback to the package
    index (without hashes) would let whoever owns a dependency's name there run code as root
    (dependency confusion). The interpreter runs isolated (``-I``): no module from the current
    directory or ``PYTHON*`` variables when it is run by hand."""
    return f"""#!/bin/sh
# Build Deskfleet's Python environment from the wheels shipped in the package.
set -eu
prefix="${{1:-{PREFIX}}}"
py="${{PYTHON:-python3}}"
extras="gui"
links="--find-links $prefix/wheels"
if [ -d "$prefix/export-wheels" ]; then
  extras="gui,export"
  links="$links --find-links $prefix/export-wheels"
fi
spec="deskfleet[$extras]=={version}"
rm -rf "$prefix/venv"
"$py" -I -m venv "$prefix/venv"
pip() {{ "$prefix/venv/bin/python" -I -m pip --disable-pip-version-check -q "$@"; }}
echo "deskfleet: installing $spec into $prefix/venv (from the bundled wheels) ..." >&2
# shellcheck disable=SC2086
if ! pip install --no-index $links "$spec"; then
  echo "deskfleet: the bundled wheels do not fit this Python ($("$py" -V 2>&1)); nothing was installed from" \
       "the network. Install the Deskfleet package built for this system's Python version." >&2
  rm -rf "$prefix/venv"
  exit 1
fi
echo "deskfleet: ready: {BIN} agent (tray) or {BIN} agent --headless" >&2
"""


def wrapper() -> str:
    return f'#!/bin/sh\nexec {PREFIX}/venv/bin/deskfleet "$@"\n'


def templates() -> str:
    """``DEBIAN/templates``: the silent install's debconf questions (see the module docstring)."""
    return f"""Template: {DEBCONF_TOKEN}
Type: password
Description: Join token for this PC's Deskfleet agent:
 The join token from the Deskfleet console ("deskfleet fleet tokens issue", or the
 console's Join tokens dialog), e.g. one reusable token for a whole roll-out. It is
 written to {JOIN_FILE}, readable by root only; the agent's system service joins
 the fleet with it and then removes the file.
 .
 Leave it empty to join later from the tray ("Join a fleet...").

Template: {DEBCONF_CONSOLE}
Type: string
Default:
Description: Enrolment address of the Deskfleet console (host:port):
 Where this PC redeems the join token, e.g. 10.0.0.5:7411 as the console shows it.
 Leave it empty to find the console on the local network (mDNS).
"""


def config_script() -> str:
    """``DEBIAN/config``: ask the questions (a pre-seeded answer is not asked again)."""
    return f"""#!/bin/sh
set -e
. /usr/share/debconf/confmodule
db_input high {DEBCONF_TOKEN} || true
db_input medium {DEBCONF_CONSOLE} || true
db_go || true
exit 0
"""


def write_token_script() -> str:
    """``write-join-token.sh PATH [CONSOLE [OWNER]]``: the join token on standard input (never an
    argument: every user may read a process's arguments) into PATH, 0600 from its first byte,
    replacing any old file atomically; CONSOLE (host:port) goes in as ``console=``; run as root,
    the file becomes OWNER's (``chown`` syntax, default ``0:0``) before it is moved in place. Exit 2,
    nothing written, for something that is not a token or an address."""
    return """#!/bin/sh
set -eu
target="$1"
console="${2:-}"
owner="${3:-0:0}"
token=""
IFS= read -r token || true
token=$(printf '%s' "$token" | tr -d ' \t\r')
case "$token" in
  DFJ1-*-*-*) ;;
  *) echo "deskfleet: the join token given is not one (it starts DFJ1-); nothing written. Copy it from the console." >&2
     exit 2 ;;
esac
if [ -n "$console" ]; then
  bad=""
  port=${console##*:}
  host=${console%:*}
  case "$console" in *[!]0-9A-Za-z.:%_[-]*) bad=1 ;; esac
  case "$port" in ""|*[!0-9]*) bad=1 ;; esac
  if [ -z "$host" ] || [ "$host" = "$console" ]; then bad=1; fi
  if [ -n "$bad" ]; then
    echo "deskfleet: the console address '$console' is not host:port (e.g. 10.0.0.5:7411); nothing written" >&2
    exit 2
  fi
fi
dir=$(dirname "$target")
umask 077
mkdir -p "$dir"
tmp=$(mktemp "$dir/.join-token.XXXXXX")
{
  printf '%s\n' "$token"
  if [ -n "$console" ]; then printf 'console=%s\n' "$console"; fi
} > "$tmp"
chmod 0600 "$tmp"
if [ "$(id -u)" = 0 ]; then chown "$owner" "$tmp"; fi
mv -f "$tmp" "$target"
"""


HANDOVER = r"""as_agent() {  # run "$@" as the agent's user, no other group, no privilege left
  if command -v setpriv >/dev/null 2>&1; then
    setpriv --reuid="$uid" --regid="$gid" --clear-groups -- "$@"
  else
    runuser -u "$user" -- "$@"
  fi
}
handover() {  # $1: root's token file (the admin's or debconf's) -> the agent user's 0600 copy, atomically
  # Written by the agent's user, never by root: the user owns $state and can swap any name in it
  # for a link to a file of root's at any moment, so root must not create, chown or rename there.
  # Root only opens its own file, as this command's stdin.
  as_agent sh -c 'umask 077; t=$(mktemp "$1/.join-token.XXXXXX") && cat > "$t" && mv -f "$t" "$1/join-token"' \
    handover "$state" < "$1"
}"""


def postinst() -> str:
    # debconf's protocol runs over stdout: everything else this script prints goes to stderr.
    return f"""#!/bin/sh
set -e
. /usr/share/debconf/confmodule
user={AGENT_USER}
state={SYSTEM_STATE}
{HANDOVER}
if [ "$1" = "configure" ]; then
  {PREFIX}/lib/install-venv.sh {PREFIX} >&2
  if command -v update-desktop-database >/dev/null 2>&1; then
    update-desktop-database -q /usr/share/applications >&2 || true
  fi
  if command -v gtk-update-icon-cache >/dev/null 2>&1; then
    gtk-update-icon-cache -q -t /usr/share/icons/hicolor >&2 || true
  fi
  # the system agent's own user: never root (it runs the stage workers on models from the network)
  if ! getent passwd "$user" >/dev/null; then
    if command -v adduser >/dev/null 2>&1; then
      adduser --system --group --home "$state" --no-create-home --quiet "$user" >&2
    else
      useradd --system --user-group --home-dir "$state" --no-create-home --shell /usr/sbin/nologin "$user" >&2
    fi
  fi
  for group in render video; do  # the iGPU's and NPU's device nodes (/dev/dri, /dev/accel)
    if getent group "$group" >/dev/null; then usermod -a -G "$group" "$user" >&2 || true; fi
  done
  uid=$(id -u "$user")
  gid=$(id -g "$user")
  umask 077
  mkdir -p "$state"
  # an older version's dir, when the agent ran as root (so its user never wrote there); once the dir is
  # the user's, root never walks it again (the user could have planted links to root's files in it)
  if [ "$(stat -c %u "$state")" != "$uid" ]; then chown -R "$user:" "$state"; fi
  chmod 0700 "$state"
  RET=""
  db_get {DEBCONF_TOKEN} || RET=""
  token="$RET"
  if [ -n "$token" ]; then
    RET=""
    db_get {DEBCONF_CONSOLE} || RET=""
    printf '%s\\n' "$token" | {WRITE_TOKEN} {JOIN_FILE} "$RET" >&2
    db_set {DEBCONF_TOKEN} "" || true  # kept in the token file only, not in debconf's database
  fi
  if [ -s {JOIN_FILE} ]; then  # from debconf, or placed there by the admin
    chown 0:0 {JOIN_FILE}
    chmod 0600 {JOIN_FILE}
    handover {JOIN_FILE}
    rm -f {JOIN_FILE}
    rmdir {JOIN_FILE.rsplit("/", 1)[0]} 2>/dev/null || true
  fi
  if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >&2 || true
    if [ -s "$state/join-token" ] || systemctl is-enabled --quiet {SYSTEM_UNIT_NAME} 2>/dev/null; then
      # restart: a new token, or an upgrade (the unit may still run as an older version's user)
      {{ systemctl enable {SYSTEM_UNIT_NAME} && systemctl restart {SYSTEM_UNIT_NAME}; }} >&2 || \\
        echo "deskfleet: could not start {SYSTEM_UNIT_NAME}; see journalctl -u {SYSTEM_UNIT_NAME}" >&2
    fi
  fi
fi
db_stop
exit 0
"""


def prerm() -> str:
    # The venv is built by postinst, so dpkg does not know its files: remove it here.
    return f"""#!/bin/sh
set -e
case "$1" in
  remove|upgrade|deconfigure)
    if [ "$1" = "remove" ] && [ -d /run/systemd/system ]; then
      systemctl disable --now {SYSTEM_UNIT_NAME} >/dev/null 2>&1 || true
    fi
    rm -rf {PREFIX}/venv ;;
esac
exit 0
"""


def postrm() -> str:
    """Purge: the token files (if still there), the system agent's state and debconf's answers.
    The ``deskfleet-agent`` user stays (Debian practice: a removed system user's uid could be
    reused by another package and inherit a file left behind)."""
    return f"""#!/bin/sh
set -e
if [ "$1" = "purge" ]; then
  rm -f {JOIN_FILE}
  rmdir /etc/deskfleet 2>/dev/null || true
  rm -rf {SYSTEM_STATE}
  if [ -e /usr/share/debconf/confmodule ]; then
    . /usr/share/debconf/confmodule
    db_purge || true
  fi
fi
exit 0
"""


def export_postinst() -> str:
    return f"""#!/bin/sh
set -e
if [ "$1" = "configure" ]; then
  {PREFIX}/lib/install-venv.sh {PREFIX}
fi
exit 0
"""


def export_postrm() -> str:
    # Back to the core-only environment once the export wheels are gone (if deskfleet stays).
    return f"""#!/bin/sh
set -e
if [ "$1" = "remove" ] && [ -x {PREFIX}/lib/install-venv.sh ]; then
  {PREFIX}/lib/install-venv.sh {PREFIX} || true
fi
exit 0
"""


def app_entry(name: str, comment: str, args: str, icon: str, categories: str) -> str:
    return ("[Desktop Entry]\nType=Application\n"
            f"Name={name}\nComment={comment}\nExec={BIN} {args}\nIcon={icon}\n"
            f"Terminal=false\nCategories={categories}\n")


def agent_entry() -> str:
    return app_entry("Deskfleet agent", "Lend this PC to the office LLM fleet while it is idle", "agent",
                     "deskfleet-agent", "Utility;Network;")


def console_entry() -> str:
    return app_entry("Deskfleet console", "Run the office LLM fleet: agents, models, placement, chat", "console",
                     "deskfleet-console", "Network;System;")


def autostart_entry() -> str:
    """The tray at every desktop login (the per-user "Start at login" setting can hide it)."""
    return desktop_entry([BIN, "agent"]) + "Icon=deskfleet-agent\n"


def systemd_user_unit() -> str:
    return f"""[Unit]
Description=Deskfleet agent (headless): lends this PC to the office LLM fleet while it is idle
Documentation=file:///usr/share/doc/deskfleet/README.md

[Service]
Type=simple
ExecStart={BIN} agent --headless
Restart=on-failure
RestartSec=10
# SIGTERM to the agent only: it stops its stage worker itself, finishing the step in hand
KillMode=mixed
TimeoutStopSec=60
Nice=10

[Install]
WantedBy=default.target
"""


def systemd_system_unit() -> str:
    """The headless agent as a system service, for rolled-out PCs (enabled by postinst when a token
    was given), as the ``deskfleet-agent`` user: postinst hands the token into that user's state
    dir, so nothing here needs root; the keys are in a 0600 file keyring there (no user keyring
    under systemd)."""
    return f"""[Unit]
Description=Deskfleet agent (system service): joins with the installer's token, lends this PC to the fleet while idle
Documentation=file:///usr/share/doc/deskfleet/README.md
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
ExecStart={BIN} agent --headless --state-dir {SYSTEM_STATE} --join-file {STATE_JOIN_FILE}
User={AGENT_USER}
Group={AGENT_USER}
# The iGPU's and NPU's device nodes (/dev/dri/*, /dev/accel/*) belong to the render and video groups:
# postinst adds the user to those of them that exist, and User= brings its groups along.
# (Not SupplementaryGroups=render video: the unit would fail to start where one of them is missing.)
StateDirectory=deskfleet-agent
StateDirectoryMode=0700
Environment=HOME={SYSTEM_STATE} XDG_CACHE_HOME={SYSTEM_STATE}/cache DESKFLEET_KEYRING_DIR={SYSTEM_STATE}/keyring
Restart=on-failure
RestartSec=10
KillMode=mixed
TimeoutStopSec=60
Nice=10
UMask=0077
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=read-only
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
# It dials and listens on IP (enrolment, hub, data plane), browses mDNS and lists interfaces (netlink);
# it needs no capability at all, and only the syscalls of an ordinary service.
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
CapabilityBoundingSet=
AmbientCapabilities=
SystemCallFilter=@system-service
SystemCallErrorNumber=EPERM
SystemCallArchitectures=native
RestrictNamespaces=yes
LockPersonality=yes
# The agent and its stage workers (a shard and its KV pool each) share this cgroup: a worker gone
# astray is stopped by the kernel before the PC's owner notices, not after.
MemoryMax={AGENT_MEMORY_MAX}
TasksMax={AGENT_TASKS_MAX}

[Install]
WantedBy=multi-user.target
"""


def copyright_file() -> str:
    return ("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
            "Upstream-Name: deskfleet\n\nFiles: *\nCopyright: Deskfleet authors\nLicense: Apache-2.0\n"
            " The bundled wheels under /opt/deskfleet carry their own licences in their metadata.\n")


def data_files(version: str) -> dict[str, tuple[str, int]]:
    """Generated files of the ``deskfleet`` package: path -> (content, mode)."""
    return {
        f"{PREFIX}/lib/install-venv.sh": (install_venv_script(version), 0o755),
        BIN: (wrapper(), 0o755),
        "/usr/share/applications/deskfleet-agent.desktop": (agent_entry(), 0o644),
        "/usr/share/applications/deskfleet-console.desktop": (console_entry(), 0o644),
        f"/etc/xdg/autostart/{DESKTOP_FILE}": (autostart_entry(), 0o644),
        f"/usr/lib/systemd/user/{UNIT_NAME}": (systemd_user_unit(), 0o644),
        f"/usr/lib/systemd/system/{SYSTEM_UNIT_NAME}": (systemd_system_unit(), 0o644),
        WRITE_TOKEN: (write_token_script(), 0o755),
        "/usr/share/doc/deskfleet/copyright": (copyright_file(), 0o644),
    }


CONFFILES = (f"/etc/xdg/autostart/{DESKTOP_FILE}",)
