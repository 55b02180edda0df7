"""A PC's share of this machine: its cores and memory, as v1 cgroups (cpu, cpuset, memory).

Whole cores are a cpuset; a fraction of a core is a CFS quota on a cpuset of whole cores (½ core:
one core, 50 % of its time), so every process in the PC sees exactly ``ceil(cores)`` CPUs in its
affinity mask. That is what OpenVINO sizes its thread pool by (it ignores CFS quotas): a ½-core PC
runs 1 inference thread, not 2 that would fight over half a core. Memory is a hard limit (there is
no swap here); the kernel's OOM killer acts inside the group only.

Groups are made under this process's own cgroup in each hierarchy (so whatever accounts for the
caller still accounts for its PCs), named ``<prefix><pid>-<pc>``: :func:`sweep_stale` removes the
groups of a run whose process is gone, after killing what they still hold.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.fleet.netns import pid_alive

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpu", "cpuset", "memory")
PERIOD_US = 100_000
_REQUIRED = {"cpu": "cpu.cfs_quota_us", "cpuset": "cpuset.cpus", "memory": "memory.limit_in_bytes"}


class ShareError(RuntimeError):
    """A PC's share cannot be made here (no controller, more cores asked than exist, a group that will not go)."""


def own_group(controller: str) -> Path:
    """This process's cgroup directory in ``controller``'s v1 hierarchy (from /proc/self/cgroup)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return ROOT / controller / path.lstrip("/")
    return ROOT / controller


def why_unavailable() -> str | None:
    """None when the v1 cpu, cpuset and memory controllers are writable here, else what is missing."""
    if os.name != "posix" or os.geteuid() != 0:
        return "cgroups need root"
    for controller, probe_file in _REQUIRED.items():
        parent = own_group(controller)
        if not (parent / probe_file).is_file():
            return f"no cgroup v1 {controller} controller at {parent} ({probe_file} missing)"
        probe = parent / f"dfprobe{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError as exc:
            return f"the cgroup v1 {controller} controller is not writable ({exc})"
    return None


def machine_cpus() -> list[int]:
    """The CPUs this process may use (its cpuset's effective CPUs)."""
    return sorted(os.sched_getaffinity(0))


@dataclass(frozen=True)
class Share:
    """``cores``: 0.5, 1, 2 ... (a fraction above 1 is a quota on ceil(cores) CPUs); ``memory_bytes``:
    the hard limit (None: unlimited)."""

    cores: float
    memory_bytes: int | None = None

    @property
    def cpus_needed(self) -> int:
        return max(1, math.ceil(self.cores - 1e-9))

    @property
    def quota_us(self) -> int | None:
        """The CFS quota per 100 ms period; None for whole cores (the cpuset alone)."""
        return None if float(self.cores).is_integer() else int(round(self.cores * PERIOD_US))


class Group:
    """One PC's cgroups (one directory per controller); :meth:`join` in a child before it execs."""

    def __init__(self, name: str, share: Share, cpus: list[int]) -> None:
        self.name, self.share, self.cpus = name, share, cpus
        self.dirs = {c: own_group(c) / name for c in CONTROLLERS}
        if (own_group("cpuacct") / "cpuacct.usage").is_file():  # CPU time, where it is its own hierarchy
            self.dirs.setdefault("cpuacct", own_group("cpuacct") / name)

    def create(self) -> Group:
        for controller, path in self.dirs.items():
            path.mkdir()
            if controller == "cpuset":
                (path / "cpuset.mems").write_text((path.parent / "cpuset.mems").read_text().strip())
                (path / "cpuset.cpus").write_text(",".join(map(str, self.cpus)))
        quota = self.share.quota_us
        if quota is not None:
            (self.dirs["cpu"] / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(quota))
        if self.share.memory_bytes is not None:
            memory = self.dirs["memory"]
            (memory / "memory.limit_in_bytes").write_text(str(self.share.memory_bytes))
            with contextlib.suppress(OSError):  # no swap here; where there is, the limit covers it too
                (memory / "memory.memsw.limit_in_bytes").write_text(str(self.share.memory_bytes))
        return self

    def join(self, pid: int | None = None) -> None:
        """Move ``pid`` (default: the caller) into every controller's group."""
        pid = os.getpid() if pid is None else pid
        for path in self.dirs.values():
            (path / "cgroup.procs").write_text(str(pid))

    def preexec(self) -> Callable[[], None]:
        """A ``preexec_fn``: the child joins before it execs, so it is capped from its first byte."""
        return self.join

    def pids(self) -> list[int]:
        found: set[int] = set()
        for path in self.dirs.values():
            with contextlib.suppress(OSError):
                found.update(int(p) for p in (path / "cgroup.procs").read_text().split())
        return sorted(found)

    def memory_report(self) -> dict[str, int]:
        memory = self.dirs["memory"]

        def read(name: str) -> int:
            with contextlib.suppress(OSError, ValueError):
                return int((memory / name).read_text())
            return 0

        oom_kills = 0
        with contextlib.suppress(OSError, ValueError):
            fields = dict(line.split() for line in (memory / "memory.oom_control").read_text().splitlines())
            oom_kills = int(fields.get("oom_kill", 0))
        return {"limit_bytes": read("memory.limit_in_bytes"), "max_usage_bytes": read("memory.max_usage_in_bytes"),
                "failcnt": read("memory.failcnt"), "oom_kills": oom_kills}

    def cpu_seconds(self) -> float:
        """CPU time used by the group so far (cpuacct, where it is mounted; else 0)."""
        acct = self.dirs.get("cpuacct", self.dirs["cpu"]) / "cpuacct.usage"
        with contextlib.suppress(OSError, ValueError):
            return int(acct.read_text()) / 1e9
        return 0.0

    def remove(self, timeout: float = 15.0) -> None:
        """SIGKILL everything in the group, then remove its directories (ShareError if one stays)."""
        _empty_and_remove(list(self.dirs.values()), timeout)


def _empty_and_remove(dirs: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for path in dirs:
        while path.exists():
            pids = []
            with contextlib.suppress(OSError):
                pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                path.rmdir()
            except FileNotFoundError:
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise ShareError(f"cannot remove cgroup {path} ({exc}); pids still in it: {pids}") from exc
                time.sleep(0.1)


def assign_cpus(shares: list[Share], cpus: list[int] | None = None) -> list[list[int]]:
    """CPUs for each share: whole cores first-fit without overlap where possible, fractions round-robin
    (two ½-core PCs share one core). ShareError when a PC asks for more cores than the machine has."""
    cpus = machine_cpus() if cpus is None else cpus
    out: list[list[int]] = []
    nxt = 0
    for share in shares:
        need = share.cpus_needed
        if need > len(cpus):
            raise ShareError(f"a PC of {share.cores:g} cores does not fit this machine's {len(cpus)} CPUs")
        out.append([cpus[(nxt + k) % len(cpus)] for k in range(need)])
        nxt = (nxt + need) % len(cpus)
    return out


def sweep_stale(prefix: str) -> list[Path]:
    """Remove the groups named ``<prefix><pid>-...`` whose creating process is gone (a crashed run's)."""
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)-")
    removed = []
    for controller in (*CONTROLLERS, "cpuacct"):
        parent = own_group(controller)
        if not parent.is_dir():
            continue
        for path in parent.iterdir():
            m = pattern.match(path.name)
            if m and path.is_dir() and not pid_alive(int(m.group(1))):
                _empty_and_remove([path], 15.0)
                removed.append(path)
    return removed
