"""The .deb postinst's token hand-over against a hostile owner of the agent's state dir (issue 29, M2).

Run as root, like dpkg runs postinst, in a private sandbox under /tmp: the state dir belongs to a
throwaway uid with no account (nothing added to /etc/passwd; the sandbox is removed afterwards). The
attacker runs as that uid, as code in a stage worker would (a shell: this machine's Python may not be
readable by other users): it plants a link to a root-owned "victim"
at the final name, then waits for the hand-over's temporary file and swaps a link to the victim in
its place. The token is fed through a FIFO so the swap lands at the worst moment every time (in the
field the attacker only has to win a race it can retry at every upgrade). Before the fix, root
wrote the token through the link and gave the victim to the attacker (chown follows links).
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from installer import deb

pytestmark = pytest.mark.skipif(os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0
                                or shutil.which("setpriv") is None,
                                reason="runs the postinst's hand-over as root (dpkg does), with setpriv")

TOKEN = "DFJ1-" + "a" * 32 + "-" + "B" * 26 + "-CCCC\nconsole=10.0.0.5:7411\n"
VICTIM_TEXT = "root:only-root-may-change-this\n"

ATTACKER = r"""
state=$1 victim=$2
ln -s "$victim" "$state/join-token"  # planted at the final name beforehand
i=0
while [ $i -lt 20000 ]; do
  for path in "$state"/.join-token.*; do
    if [ -e "$path" ]; then
      mv "$path" "$state/stolen" && ln -s "$victim" "$path" && echo swapped && exit 0
    fi
  done
  i=$((i + 1))
  sleep 0.001
done
echo "nothing to swap"
exit 1
"""


def _free_uid() -> int:
    for uid in range(61000, 62000):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
    raise RuntimeError("no free uid in 61000-61999 for the throwaway agent user")


@pytest.fixture
def sandbox():
    root = Path(tempfile.mkdtemp(prefix="deskfleet-handover-"))
    root.chmod(0o755)  # the throwaway uid must reach its state dir, as /var/lib lets it
    uid = _free_uid()
    state = root / "state"
    state.mkdir(mode=0o700)
    os.chown(state, uid, uid)
    victim = root / "victim"  # stands in for /etc/shadow or /etc/sudoers.d/x
    victim.write_text(VICTIM_TEXT)
    victim.chmod(0o644)
    try:
        yield root, state, victim, uid
    finally:
        shutil.rmtree(root)


def _handover(state: Path, uid: int, source: Path) -> subprocess.Popen:
    script = f"set -e\nuser=deskfleet-test-unused\nuid={uid}\ngid={uid}\nstate={state}\n{deb.HANDOVER}\n" \
             f'handover "{source}"\n'
    return subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _open_writer(fifo: Path, deadline: float) -> int:
    while True:  # O_NONBLOCK: ENXIO until the hand-over opens its end
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _assert_untouched(victim: Path) -> None:
    info = os.lstat(victim)
    assert stat.S_ISREG(info.st_mode) and info.st_uid == 0 and info.st_gid == 0, \
        f"the attacker's uid got root's file: {info.st_uid}:{info.st_gid}"
    assert stat.S_IMODE(info.st_mode) == 0o644 and victim.read_text() == VICTIM_TEXT


def test_the_handover_gives_the_agent_user_its_own_0600_copy(sandbox):
    root, state, victim, uid = sandbox
    source = root / "join-token"  # root's /etc/deskfleet/join-token
    source.write_text(TOKEN)
    source.chmod(0o600)
    proc = _handover(state, uid, source)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    copy = state / "join-token"
    info = os.lstat(copy)
    assert stat.S_ISREG(info.st_mode) and (info.st_uid, info.st_gid) == (uid, uid)
    assert stat.S_IMODE(info.st_mode) == 0o600 and copy.read_text() == TOKEN
    assert [p.name for p in state.iterdir()] == ["join-token"]  # no temporary file left


def test_a_racing_owner_of_the_state_dir_cannot_get_a_file_of_roots(sandbox):
    root, state, victim, uid = sandbox
    fifo = root / "token.fifo"
    os.mkfifo(fifo, 0o600)
    attacker = subprocess.Popen(["sh", "-c", ATTACKER, "attacker", str(state), str(victim)], user=uid, group=uid,
                                extra_groups=[], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = _handover(state, uid, fifo)
    writer = -1
    try:
        deadline = time.monotonic() + 30
        writer = _open_writer(fifo, deadline)
        said = attacker.stdout.readline().strip()
        assert said == "swapped", (said, attacker.stderr.read())  # the attack ran: the link was in place in time
        os.set_blocking(writer, True)
        os.write(writer, TOKEN.encode())
    finally:
        if writer >= 0:
            os.close(writer)
        out, err = proc.communicate(timeout=60)
        attacker.communicate(timeout=30)
    _assert_untouched(victim)
    # what the attacker got is its own: at most the token it is given anyway, in files of its uid (the
    # hand-over, writing as that uid, either wrote the renamed file or was refused by the link: both fine)
    assert proc.returncode == 0 or "Permission denied" in err, err
    assert os.lstat(state / "stolen").st_uid == uid
    assert not any(os.lstat(p).st_uid == 0 for p in state.iterdir())
