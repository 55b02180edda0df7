"""The emulated office's parts that need no fleet: how cores are dealt to PCs (pure), and the sweep
that removes what a crashed run left (root: real namespaces, links and cgroups, a second or two)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.office import share
from tests.support.office.office import PREFIX, leftovers, sweep_stale, why_unavailable
from tests.support.office.share import Group, Share, ShareError, assign_cpus


def test_half_core_pcs_share_a_cpu_by_quota_and_whole_cores_get_their_own():
    assert Share(0.5).quota_us == 50_000 and Share(0.5).cpus_needed == 1
    assert Share(1.0).quota_us is None and Share(2.0).cpus_needed == 2
    assert Share(1.5).quota_us == 150_000 and Share(1.5).cpus_needed == 2
    assert assign_cpus([Share(0.5)] * 4, [0, 1]) == [[0], [1], [0], [1]]
    assert assign_cpus([Share(2.0), Share(1.0)], [0, 1, 2]) == [[0, 1], [2]]
    with pytest.raises(ShareError, match="3 cores does not fit this machine's 2 CPUs"):
        assign_cpus([Share(3.0)], [0, 1])


# What a stage worker's CPU plugin does by default: one inference thread per CPU it may run on.
OPENVINO_THREADS = """
import numpy as np, openvino as ov
from openvino import opset13 as ops
x = ops.parameter([1, 8], np.float32)
model = ov.Model([ops.matmul(x, ops.constant(np.ones((8, 8), np.float32)), False, False)], [x])
print(ov.Core().compile_model(model, "CPU").get_property("INFERENCE_NUM_THREADS"))
"""


def _dead_pid() -> int:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


@pytest.mark.skipif(why_unavailable() is not None, reason=f"no emulated office here: {why_unavailable()}")
def test_a_crashed_runs_namespaces_links_cgroups_and_processes_are_swept_and_a_live_runs_kept():
    dead = _dead_pid()
    ns, bridge = f"{PREFIX}{dead}h1", f"{PREFIX}br{dead}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True)
    stale = Group(f"{PREFIX}{dead}-1desk", Share(0.5, 64 << 20), [0]).create()
    sleeper = subprocess.Popen(["sleep", "600"], preexec_fn=stale.preexec())
    live = Group(f"{PREFIX}{os.getpid()}-9live", Share(1.0), [0]).create()
    try:
        assert leftovers(dead), "the crashed run's leftovers were not made"
        sweep_stale()
        assert leftovers(dead) == []
        assert sleeper.wait(10) == -9  # what ran in the crashed run's PC is killed
        assert all(path.is_dir() for path in live.dirs.values()), "a live run's cgroups were swept"
    finally:
        live.remove()
        for argv in (["ip", "netns", "del", ns], ["ip", "link", "del", bridge]):
            subprocess.run(argv, capture_output=True)
        if sleeper.poll() is None:
            sleeper.kill()
        stale.remove()
    assert not any(p.name.startswith(f"{PREFIX}{dead}-") for p in share.own_group("cpu").iterdir())


@pytest.mark.skipif(why_unavailable() is not None, reason=f"no emulated office here: {why_unavailable()}")
def test_a_pc_over_its_memory_limit_is_killed_inside_it_and_a_failed_run_leaves_nothing(tmp_path):
    from tests.support.office.office import OfficeSpec, building
    from tests.support.office.pc import PcSpec

    spec = OfficeSpec(desks=(PcSpec("desk", cores=0.5, memory_mb=64),), server=PcSpec("server", display=False),
                      people=PcSpec("people", display=False))
    with pytest.raises(RuntimeError, match="a test failing mid-run"), building(spec, tmp_path) as pcs:
        desk = pcs[2]
        hog = desk.run([sys.executable, "-c", "b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096])"],
                       timeout=60)
        assert hog.returncode == -9, hog  # the kernel's OOM killer, inside the PC only
        memory = desk.group.memory_report()
        assert memory["oom_kills"] >= 1 and memory["max_usage_bytes"] <= memory["limit_bytes"] == 64 << 20, memory
        probe = desk.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], timeout=30)
        assert probe.stdout.strip() == str(desk.cpus) and len(desk.cpus) == 1  # half a core: one CPU to see
        compiled = desk.run([sys.executable, "-c", OPENVINO_THREADS], timeout=120)
        assert compiled.stdout.strip() == "1", compiled  # so OpenVINO runs one thread there, not one per machine core
        sleeper = desk.popen(["sleep", "600"], tmp_path / "sleep.log")
        xvfb = desk.display.pid
        raise RuntimeError("a test failing mid-run")
    assert leftovers() == []
    assert sleeper.wait(10) is not None
    assert not os.path.exists(f"/proc/{xvfb}") or "zombie" in open(f"/proc/{xvfb}/status").read().lower()


def test_the_skip_reason_names_what_is_missing(tmp_path, monkeypatch):
    from tests.support.office import display

    monkeypatch.setattr(share, "ROOT", tmp_path)
    for controller, probe in (("cpu", "cpu.cfs_quota_us"), ("cpuset", "cpuset.cpus")):
        share.own_group(controller).mkdir(parents=True)
        (share.own_group(controller) / probe).write_text("")
    reason = share.why_unavailable()
    if os.geteuid() == 0:
        assert reason is not None and "no cgroup v1 memory controller" in reason, reason
    else:
        assert reason == "cgroups need root"
    monkeypatch.setattr(display.shutil, "which", lambda tool: None if tool == "xdotool" else f"/usr/bin/{tool}")
    assert "xdotool is not installed" in display.why_unavailable()
