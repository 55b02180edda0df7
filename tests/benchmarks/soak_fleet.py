"""The soak benchmark's fleets: ``deskfleet serve --workers`` in its own process, one per runtime
(the paged one: the stateful runtime the soak also drove was retired from serving in issue 27),
and where each process's memory goes.

A fleet's processes are the coordinator + API (the ``serve`` process) and a worker per stage.
Their RSS is split, from ``/proc/<pid>/smaps``, into file-backed pages (weights mapped from the
export, libraries), the paged KV pool's pages (anonymous mappings of exactly one cache tensor's
size: ``np.zeros`` in the paged stage, so a page is resident only once a block on it was written),
and the rest of the anonymous memory (heaps, OpenVINO's compiled kernels and shape caches).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from engine.errors import DeskfleetError

START_TIMEOUT_S = 600.0
RUNTIMES = ("paged",)  # serve's runtime for CPU and GPU exports (issue 27 retired the stateful one)


@dataclass(frozen=True)
class FleetSettings:
    """How every fleet is served (``deskfleet serve --workers`` options)."""

    slots: int = 4
    max_concurrent: int = 16
    kv_pool_mb: float = 192.0  # the block pool per stage
    token_budget: int = 256  # new tokens per step
    # glibc's mmap threshold, fixed for every process of every fleet (0: glibc's own, which rises
    # with the largest block freed, up to 32 MiB): fixed, every allocation of at least this size is
    # a mapping of its own, so the KV pool's tensors can be told apart in smaps.
    mmap_threshold_mb: float = 4.0

    def env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.mmap_threshold_mb > 0:
            env["MALLOC_MMAP_THRESHOLD_"] = str(int(self.mmap_threshold_mb * 2**20))
        return env

    def argv(self, runtime: str) -> list[str]:
        """``serve``'s options for ``runtime`` (the paged runtime is serve's own: no flag names it)."""
        if runtime not in RUNTIMES:
            raise DeskfleetError(f"unknown runtime {runtime!r}; expected one of {', '.join(RUNTIMES)}")
        return ["--slots", str(self.slots), "--max-concurrent", str(self.max_concurrent),
                "--kv-pool-mb", f"{self.kv_pool_mb:g}", "--token-budget", str(self.token_budget)]

    def describe(self, runtime: str) -> str:
        return " ".join(self.argv(runtime))


class FleetProcess:
    """``deskfleet serve --workers`` serving runtime R on a free loopback port; stderr goes to a log file."""

    def __init__(self, export_dir: Path, log_path: Path, runtime: str, settings: FleetSettings) -> None:
        if runtime not in RUNTIMES:
            raise DeskfleetError(f"unknown runtime {runtime!r}; expected one of {', '.join(RUNTIMES)}")
        self.export_dir, self.log_path, self.runtime, self.settings = export_dir, log_path, runtime, settings
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> str:
        argv = [sys.executable, "-m", "engine.cli.main", "serve", "--shards", str(self.export_dir), "--workers",
                "--port", "0", *self.settings.argv(self.runtime)]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - kept open for the server's life
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=self.settings.env())
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise DeskfleetError(f"the {self.runtime} fleet exited with {self.proc.returncode} before serving; "
                                     f"see {self.log_path}")
            if found := re.search(r"http://\S+/v1", line):
                self.url = found.group(0)
                return self.url
        raise DeskfleetError(f"the {self.runtime} fleet did not start within {START_TIMEOUT_S:.0f} s; "
                             f"see {self.log_path}")

    def processes(self) -> dict[str, psutil.Process]:
        """'coordinator + API' and 'worker stage N' -> process, for every process of the fleet."""
        assert self.proc is not None
        root = psutil.Process(self.proc.pid)
        found = {"coordinator + API": root}
        for child in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                cmd = child.cmdline()
                name = f"worker stage {cmd[cmd.index('--stage') + 1]}" if "--stage" in cmd else f"child {child.pid}"
                found[name] = child
        return found

    def rss(self) -> dict[str, int]:
        out = {}
        for name, proc in self.processes().items():
            with contextlib.suppress(psutil.Error):
                out[name] = proc.memory_info().rss
        return out

    def metrics(self) -> dict[str, float]:
        """The fleet's ``/metrics`` samples without labels, ``deskfleet_`` dropped."""
        return parse_metrics(get_json(self.url.removesuffix("/v1") + "/metrics"))

    def memory(self, pool_tensor_bytes: int | None) -> dict[str, dict[str, int]]:
        """Per process: rss, file, kv_pool and other_anon bytes (see :func:`smaps_breakdown`)."""
        out = {}
        for name, proc in self.processes().items():
            with contextlib.suppress(psutil.Error, OSError):
                out[name] = smaps_breakdown(proc.pid, pool_tensor_bytes if name.startswith("worker") else None)
        return out

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()
        return self.proc.returncode


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:  # loopback only
        text = r.read().decode()
    return json.loads(text) if text.lstrip().startswith(("{", "[")) else text


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for found in re.finditer(r"^deskfleet_(\w+) (\S+)$", text, re.M):
        with contextlib.suppress(ValueError):
            out[found.group(1)] = float(found.group(2))
    return out


_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ (\d+)\s*(.*)$")


def smaps_breakdown(pid: int | str, pool_tensor_bytes: int | None = None) -> dict[str, int]:
    """Resident bytes of ``pid`` by kind: ``file`` (mapped files), ``kv_pool`` (anonymous mappings
    whose size is one cache tensor of ``pool_tensor_bytes``, give or take two pages: numpy's
    hugepage advice splits an array's mapping into the allocator's header page and the rest),
    ``other_anon`` (every other page), and ``kv_pool_mappings`` (how many such mappings)."""
    out = {"rss": 0, "file": 0, "kv_pool": 0, "other_anon": 0, "kv_pool_mappings": 0}
    kind = "other_anon"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if m := _MAPPING.match(line):
            size = int(m.group(2), 16) - int(m.group(1), 16)
            path, inode = m.group(4).strip(), int(m.group(3))
            if inode != 0 or (path and not path.startswith("[")):
                kind = "file"
            elif pool_tensor_bytes and abs(size - pool_tensor_bytes) <= 2 * 4096:
                kind = "kv_pool"
                out["kv_pool_mappings"] += 1
            else:
                kind = "other_anon"
        elif line.startswith("Rss:"):
            resident = int(line.split()[1]) * 1024
            out[kind] += resident
            out["rss"] += resident
    return out


def pool_tensor_bytes(export_dir: Path, pool_blocks: int, block_size: int = 32) -> int:
    """Bytes of one key (or value) cache tensor of the paged stages of ``export_dir``:
    ``[pool_blocks, kv_heads, block_size, head_dim]`` at the first stage's KV precision (f16 or f32)."""
    from engine.shards.manifest import load_manifest

    manifest = load_manifest(export_dir)
    model = manifest.model
    width = 4 if manifest.stages[0].kv_cache_precision.lower() == "f32" else 2
    return pool_blocks * model.num_kv_heads * block_size * model.head_dim * width
