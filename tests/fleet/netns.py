"""Several "hosts" on one machine: Linux network namespaces on a private bridge (root only).

Each host is a namespace with one veth interface on bridge ``<prefix>br<pid>``, an address in a
private test subnet, ``lo`` up and a multicast route, so zeroconf in one namespace finds
services in another, like PCs on one office LAN. Nothing is added to the machine's own
interfaces except the bridge and the veth ends, and all of it is removed at the end. Only these
addresses and loopback are ever used.

Every name carries the creating process's pid, so a run killed before its cleanup leaves
namespaces and links that :func:`sweep_stale` recognises (their pid is gone) and removes, and a
live run's are never touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def why_unavailable() -> str | None:
    """None when namespaces can be made here, else the reason (for a clear skip)."""
    if os.name != "posix" or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = f"df-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot create a network namespace here ({exc})"
    _ip("netns", "del", probe)
    return None


@dataclass(frozen=True)
class Host:
    name: str  # the namespace
    address: str
    veth: str = ""  # the outer end of its cable, on the bridge

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def enter_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` in this host's network namespace only (``nsenter``): unlike ``ip netns exec`` it
        keeps the machine's /sys, so a process there still sees its cgroup files."""
        return ["nsenter", f"--net=/var/run/netns/{self.name}", "--", *argv]


def kill_namespace_processes(host: Host) -> None:
    """SIGKILL everything still running in ``host``'s namespace (a namespace with live processes
    outlives ``ip netns del``)."""
    out = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True, timeout=10)
    for pid in out.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(prefix: str) -> list[str]:
    """Remove the namespaces and links a crashed earlier run with ``prefix`` left (names
    ``<prefix>br<pid>``, ``<prefix><pid>h<i>``, ``<prefix>v<pid>h<i>`` whose pid is gone); the names removed."""
    pattern = re.compile(rf"^{re.escape(prefix)}(?:br|v)?(\d+)(?:h\d+)?$")
    removed: list[str] = []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    for line in listed.splitlines():
        name = line.split(" ")[0]
        m = pattern.match(name)
        if m and not pid_alive(int(m.group(1))):
            kill_namespace_processes(Host(name, ""))
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", name)
                removed.append(name)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    for line in links.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = pattern.match(name)
        if m and not pid_alive(int(m.group(1))):
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("link", "del", name)
                removed.append(name)
    return removed


@contextlib.contextmanager
def namespaces(n_hosts: int, *, subnet: str = "10.231.77", prefix: str = "df") -> Iterator[list[Host]]:
    """``n_hosts`` namespaces on one bridge, addresses ``<subnet>.1 .. .n``; torn down on exit.
    ``prefix`` (a few letters) names them all: one prefix per harness, so their sweeps stay apart."""
    tag = f"{os.getpid()}"
    bridge = f"{prefix}br{tag}"
    hosts: list[Host] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        with contextlib.suppress(subprocess.CalledProcessError):  # let multicast flood like a plain hub
            _ip("link", "set", bridge, "type", "bridge", "mcast_snooping", "0")
        _ip("link", "set", bridge, "up")
        for i in range(1, n_hosts + 1):
            ns, outer = f"{prefix}{tag}h{i}", f"{prefix}v{tag}h{i}"
            _ip("netns", "add", ns)
            hosts.append(Host(ns, f"{subnet}.{i}", outer))
            _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{subnet}.{i}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
        yield hosts
    finally:
        for host in hosts:
            kill_namespace_processes(host)
            with contextlib.suppress(subprocess.CalledProcessError):  # now: the kernel frees a namespace's
                _ip("link", "del", host.veth)                         # veth later, after `netns del` returns
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", host.name)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", bridge)
