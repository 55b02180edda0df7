"""`deskfleet doctor`: every rule against healthy and broken facts (pure), the gatherers against
real healthy and real broken conditions where they are cheap to make (a port in use, a keyring
directory that cannot be created, a disk threshold above the free space, a console whose clock is
an hour off, an interface this host does not have), and the command's exit code and fixes."""

from __future__ import annotations

import email.utils
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import openvino  # noqa: F401  (importing it starts a thread: do it before the leak check)
import psutil
import pytest
from aiohttp import web

from engine.doctor import facts as g
from engine.doctor.checks import (
    ClockFacts,
    DeviceFacts,
    DiskFacts,
    Facts,
    FirewallFacts,
    KeyringFacts,
    MulticastFacts,
    PortFacts,
    Status,
    check_clock,
    check_devices,
    check_disk,
    check_firewall,
    check_keyring,
    check_multicast,
    check_port,
    diagnose,
    exit_code,
    report,
)
from engine.trust.fleet_ca import FleetAuthority, Role
from engine.trust.keystore import FileKeyring
from tests.support.agent_helpers import console
from tests.support.asyncutil import run

LINUX_CPU = DeviceFacts(platform="linux", devices=("CPU",), in_render_group=True)
GPU_NODE = "/dev/dri/renderD128"


def _by_check(findings, prefix):
    return next(f for f in findings if f.check.startswith(prefix))


def test_device_rules_name_the_usual_reason_a_gpu_or_npu_is_missing():
    assert all(f.status is Status.OK for f in check_devices(LINUX_CPU))
    gpu = replace(LINUX_CPU, intel_gpu_pci=True)
    cases = {
        "kernel": (gpu, "/dev/dri is absent", "i915"),
        "group": (replace(gpu, render_nodes=(GPU_NODE,), node_access={GPU_NODE: False}, in_render_group=False),
                  "not in the render group", "usermod -aG render"),
        "perms": (replace(gpu, render_nodes=(GPU_NODE,), node_access={GPU_NODE: False}),
                  "not readable and writable", "udev"),
        "runtime": (replace(gpu, render_nodes=(GPU_NODE,), node_access={GPU_NODE: True}),
                    "user-space driver is missing", "intel-opencl-icd"),
    }
    for name, (facts, summary, fix) in cases.items():
        finding = _by_check(check_devices(facts), "GPU")
        assert finding.status is Status.FAIL, name
        assert summary in finding.summary and fix in finding.fix, (name, finding)
    working = replace(gpu, devices=("CPU", "GPU.0"), render_nodes=(GPU_NODE,), node_access={GPU_NODE: True})
    assert _by_check(check_devices(working), "GPU").status is Status.OK

    npu = replace(LINUX_CPU, intel_npu_pci=True, accel_nodes=("/dev/accel/accel0",),
                  node_access={"/dev/accel/accel0": True})
    assert "linux-npu-driver" in _by_check(check_devices(npu), "NPU").fix
    assert "intel_vpu" in _by_check(check_devices(replace(npu, accel_nodes=())), "NPU").fix
    assert _by_check(check_devices(replace(npu, npu_userspace=True)), "NPU").status is Status.WARN

    windows = check_devices(DeviceFacts(platform="win32", devices=("CPU",)))
    assert _by_check(windows, "GPU").status is Status.WARN
    broken = check_devices(DeviceFacts(platform="linux", openvino_error="ImportError: no openvino"))
    assert [f.status for f in broken] == [Status.FAIL] and "reinstall" in broken[0].fix
    assert _by_check(check_devices(replace(LINUX_CPU, devices=("GPU.0",))), "CPU").status is Status.FAIL


def test_network_keyring_disk_and_clock_rules():
    assert check_multicast(MulticastFacts("127.0.0.1", seconds=1.7)).status is Status.OK
    mdns = check_multicast(MulticastFacts("10.0.0.9", error="No such device"))
    assert mdns.status is Status.FAIL and "--seed" in mdns.fix and "5353" in mdns.fix

    port = PortFacts("control", "127.0.0.1", 7210)
    assert check_port(port).status is Status.OK
    other = check_port(replace(port, bind_error="Address in use", in_use=True, holder="nginx (pid 7)"))
    assert other.status is Status.FAIL and "nginx (pid 7)" in other.summary and "--control-port" in other.fix
    ours = replace(port, bind_error="Address in use", in_use=True, holder="deskfleet (pid 8)", held_by_agent=True)
    assert check_port(ours).status is Status.OK
    assert "firewall" in check_port(replace(port, connect_error="refused")).fix

    assert "ufw allow" in check_firewall(FirewallFacts(ufw_active=True), (7210, 7211)).fix
    assert "--add-port=7211/tcp" in check_firewall(FirewallFacts(firewalld_running=True), (7210, 7211)).fix
    assert check_firewall(FirewallFacts(False, False), (7210,)).status is Status.OK

    assert check_keyring(KeyringFacts("FileKeyring", True, "/x")).status is Status.OK
    assert "DESKFLEET_KEYRING_DIR" in check_keyring(KeyringFacts("FileKeyring", True, "/x", "denied")).fix
    assert "unlock" in check_keyring(KeyringFacts("SecretService", False, None, "locked")).fix

    assert check_disk(DiskFacts("/s", 5 * 2**30, 4 * 2**30)).status is Status.OK
    assert "--state-dir" in check_disk(DiskFacts("/s", 1 * 2**30, 4 * 2**30)).fix

    assert check_clock(ClockFacts(None)).status is Status.SKIP
    assert check_clock(ClockFacts("h:1", skew_s=2.0)).status is Status.OK
    assert check_clock(ClockFacts("h:1", skew_s=-90.0)).status is Status.WARN
    late = check_clock(ClockFacts("h:1", skew_s=3600.0))
    assert late.status is Status.FAIL and "3600 s behind" in late.summary and "timedatectl" in late.fix
    assert check_clock(ClockFacts("h:1", error="refused")).status is Status.FAIL


def test_a_report_lists_every_failure_with_its_fix_and_exits_non_zero():
    healthy = Facts(LINUX_CPU, MulticastFacts("127.0.0.1", 1.0), (PortFacts("control", "127.0.0.1", 1),),
                    FirewallFacts(), KeyringFacts("k", False), DiskFacts("/", 2, 1), ClockFacts(None))
    findings = diagnose(healthy)
    assert exit_code(findings) == 0 and report(findings).endswith("No problems found.")
    broken = replace(healthy, disk=DiskFacts("/", 1, 2), keyring=KeyringFacts("k", False, error="locked"))
    findings = diagnose(broken)
    text = report(findings)
    assert exit_code(findings) == 1 and text.endswith("2 problems found.")
    assert text.count("fix:") == 2


def test_device_facts_come_from_sysfs_device_nodes_and_drivers(tmp_path):
    class FakeCore:
        available_devices = ["CPU"]

    def put(rel: str, text: str = "") -> None:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)

    put("sys/bus/pci/devices/0000:00:02.0/vendor", "0x8086\n")
    put("sys/bus/pci/devices/0000:00:02.0/class", "0x030000\n")
    put("sys/bus/pci/devices/0000:01:00.0/vendor", "0x10de\n")  # another vendor's GPU: not ours to use
    put("sys/bus/pci/devices/0000:01:00.0/class", "0x030000\n")
    put("dev/dri/renderD128")
    put("sys/class/drm/renderD128/device/vendor", "0x8086")
    put("dev/dri/renderD129")
    put("sys/class/drm/renderD129/device/vendor", "0x10de")
    facts = g.gather_devices(root=tmp_path, core=FakeCore(), platform="linux")
    assert facts.intel_gpu_pci and not facts.intel_npu_pci
    assert facts.render_nodes == (str(tmp_path / "dev/dri/renderD128"),)
    assert _by_check(check_devices(facts), "GPU").fix.endswith("intel-opencl-icd)")
    put("etc/OpenCL/vendors/intel.icd", "libigdrcl.so")
    facts = g.gather_devices(root=tmp_path, core=FakeCore(), platform="linux")
    assert facts.opencl_icds and _by_check(check_devices(facts), "GPU").status is Status.WARN

    class BrokenCore:
        @property
        def available_devices(self):
            raise RuntimeError("plugin load failed")

    assert "plugin load failed" in g.gather_devices(root=tmp_path, core=BrokenCore()).openvino_error
    real = g.gather_devices()  # this machine: OpenVINO's CPU, no Intel GPU or NPU
    assert "CPU" in real.devices and real.openvino_error is None


def test_a_port_in_use_is_found_and_named():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        busy = g.probe_port("control", "127.0.0.1", port)
        assert busy.in_use and not busy.held_by_agent
        assert busy.holder is not None and f"pid {os.getpid()}" in busy.holder
        assert check_port(busy).status is Status.FAIL
    free = g.probe_port("data", "127.0.0.1", port)
    assert check_port(free).status is Status.OK, free
    assert check_port(g.probe_port("data", "127.0.0.1", 0)).status is Status.OK


def test_keyring_writable_and_not(tmp_path):
    ok = g.probe_keyring(FileKeyring(tmp_path / "keys"))
    assert check_keyring(ok).status is Status.OK and ok.file_backend
    assert not (tmp_path / "keys" / "keyring.json").read_text().count("doctor-probe")  # cleaned up
    (tmp_path / "a-file").write_text("")  # a directory cannot be made under a file, even by root
    broken = g.probe_keyring(FileKeyring(tmp_path / "a-file" / "keys"))
    finding = check_keyring(broken)
    assert finding.status is Status.FAIL and "a-file" in finding.summary


def test_disk_threshold(tmp_path):
    free = psutil.disk_usage(str(tmp_path)).free
    assert check_disk(g.gather_disk(tmp_path / "not" / "yet", 1 << 20)).status is Status.OK
    assert check_disk(g.gather_disk(tmp_path, free * 4)).status is Status.FAIL


def test_multicast_self_test_on_loopback_and_on_a_missing_interface():
    assert check_multicast(run(g.async_multicast_selftest("127.0.0.1"), 60)).status is Status.OK
    absent = "203.0.113.77"
    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    if absent in local:
        pytest.skip(f"{absent} is one of this host's addresses")
    facts = run(g.async_multicast_selftest(absent, timeout=3), 60)
    assert facts.error and check_multicast(facts).status is Status.FAIL


def test_clock_against_a_real_console_and_one_an_hour_off(tmp_path):
    async def main():
        async with console(tmp_path / "console") as con:
            good = await g.async_console_clock(con.enrollment)

        async def stale_date(request):
            resp = web.Response(text="ca")
            resp.headers["Date"] = email.utils.formatdate(time.time() - 3600, usegmt=True)
            return resp

        app = web.Application()
        app.router.add_get("/v1/ca", stale_date)
        runner = web.AppRunner(app)
        await runner.setup()
        creds = FleetAuthority.create("clock").issue_credentials("c", role=Role.CONSOLE)
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=creds.server_context(verify_clients=False))
        await site.start()
        try:
            late = await g.async_console_clock(f"127.0.0.1:{runner.addresses[0][1]}")
        finally:
            await runner.cleanup()
        gone = await g.async_console_clock("127.0.0.1:9", timeout=3)
        return good, late, gone

    good, late, gone = run(main(), 60)
    assert check_clock(good).status is Status.OK and abs(good.skew_s) < 2
    assert check_clock(late).status is Status.FAIL and -3602 < late.skew_s < -3598
    assert check_clock(gone).status is Status.FAIL


def _doctor(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DESKFLEET_KEYRING_DIR": str(tmp_path / "keyring")}
    return subprocess.run([sys.executable, "-m", "engine.cli.main", "doctor", "--interface", "127.0.0.1",
                           "--state-dir", str(tmp_path / "agent"), "--control-port", "0", *extra],
                          capture_output=True, text=True, timeout=120, env=env)


def test_the_command_exits_zero_when_healthy_and_non_zero_with_fixes_when_not(tmp_path):
    healthy = _doctor(tmp_path, "--data-port", "0")
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert "No problems found." in healthy.stdout and "mDNS discovery on 127.0.0.1" in healthy.stdout
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        broken = _doctor(tmp_path, "--data-port", str(port), "--min-free-gb", "1e9")
    assert broken.returncode == 1
    assert f"FAIL  data port {port} on 127.0.0.1: already in use" in broken.stdout
    assert "--data-port N" in broken.stdout and "2 problems found." in broken.stdout
