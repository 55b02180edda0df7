"""One emulated PC: a network namespace on the office bridge (tests.fleet.netns), a share of the
machine's cores and memory (:mod:`.share`) and, for a desk PC, its own display (:mod:`.display`).

Every process a PC runs joins the PC's cgroups before it execs and enters its network namespace
with ``nsenter`` (which, unlike ``ip netns exec``, leaves /sys as it is: the process can still read
its cgroup's limits), so its children (the agent's stage worker) are in the PC too.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.fleet.netns import Host
from tests.support.office.display import Display
from tests.support.office.share import Group, Share


@dataclass(frozen=True)
class PcSpec:
    """What a PC is: ``cores`` (0.5: half a core), ``memory_mb`` (None: no limit), a ``display``
    (a desk someone can sit at) and its cable's speed (None: the bridge's)."""

    name: str
    cores: float = 1.0
    memory_mb: int | None = None
    display: bool = True
    cable_mbit: float | None = None

    @property
    def share(self) -> Share:
        return Share(self.cores, None if self.memory_mb is None else self.memory_mb << 20)


@dataclass(frozen=True)
class Pc:
    spec: PcSpec
    host: Host
    group: Group
    display: Display | None
    root: Path  # this PC's own directory (state dirs, logs)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def address(self) -> str:
        return self.host.address

    @property
    def cpus(self) -> list[int]:
        return self.group.cpus

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a process on this PC: the caller's, its display's (or none), ``extra``."""
        env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "XDG_SESSION_TYPE")}
        if self.display is not None:
            env.update(self.display.env)
        env.update(extra or {})
        return env

    def argv(self, argv: Sequence[str]) -> list[str]:
        return self.host.enter_argv(argv)

    def popen(self, argv: Sequence[str], log: Path, *, env: Mapping[str, str] | None = None,
              cwd: Path | None = None, stdin: int = subprocess.DEVNULL) -> subprocess.Popen:
        """Start ``argv`` on this PC (its namespace, its cgroups, its display); output to ``log``."""
        with log.open("ab") as out:
            return subprocess.Popen(self.argv(argv), stdout=out, stderr=out, stdin=stdin, env=self.env(env), cwd=cwd,
                                    preexec_fn=self.group.preexec(), start_new_session=True)

    def run(self, argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` on this PC to the end; its output captured."""
        return subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=timeout, env=self.env(env),
                              cwd=cwd, preexec_fn=self.group.preexec())
