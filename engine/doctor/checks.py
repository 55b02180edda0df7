"""``deskfleet doctor``: what stands between this PC and the fleet, each with its fix.

Pure: every check is a function of facts gathered beforehand (:mod:`engine.doctor.facts` does
the I/O), so each rule is tested against healthy and broken facts without the broken machine.
A check returns a :class:`Finding`; any ``FAIL`` makes the command exit non-zero, and every
``FAIL`` and ``WARN`` carries a fix a person can act on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "FAIL"
    SKIP = "skip"


@dataclass(frozen=True)
class Finding:
    check: str
    status: Status
    summary: str
    fix: str = ""


@dataclass(frozen=True)
class DeviceFacts:
    """OpenVINO's view and the OS's view of this PC's accelerators (Linux fields empty elsewhere)."""

    platform: str  # sys.platform
    devices: tuple[str, ...] = ()  # openvino.Core().available_devices
    openvino_error: str | None = None
    intel_gpu_pci: bool = False  # an Intel display controller on the PCI bus
    intel_npu_pci: bool = False  # an Intel processing accelerator (the NPU) on the PCI bus
    render_nodes: tuple[str, ...] = ()  # /dev/dri/renderD* of Intel GPUs
    accel_nodes: tuple[str, ...] = ()  # /dev/accel/accel* of Intel NPUs
    node_access: Mapping[str, bool] = field(default_factory=dict)  # node -> read+write for this user
    in_render_group: bool | None = None
    opencl_icds: tuple[str, ...] = ()  # /etc/OpenCL/vendors/*.icd (the GPU plugin runs on OpenCL)
    npu_userspace: bool = False  # the Level Zero NPU driver library (libze_intel_vpu)


@dataclass(frozen=True)
class MulticastFacts:
    interface: str
    seconds: float | None = None  # how long the self-test took to find its own service
    error: str | None = None


@dataclass(frozen=True)
class PortFacts:
    name: str  # "control" or "data"
    interface: str
    port: int
    bind_error: str | None = None
    in_use: bool = False
    holder: str | None = None  # "python3 (pid 42)" when the port is taken and the holder is known
    held_by_agent: bool = False
    connect_error: str | None = None


@dataclass(frozen=True)
class FirewallFacts:
    ufw_active: bool | None = None
    firewalld_running: bool | None = None


@dataclass(frozen=True)
class KeyringFacts:
    backend: str
    file_backend: bool
    location: str | None = None
    error: str | None = None  # None: a probe secret was written, read back and deleted


@dataclass(frozen=True)
class DiskFacts:
    path: str
    free_bytes: int
    need_bytes: int


@dataclass(frozen=True)
class ClockFacts:
    console: str | None
    skew_s: float | None = None  # console's clock minus ours (positive: ours is behind)
    error: str | None = None


@dataclass(frozen=True)
class Facts:
    devices: DeviceFacts
    multicast: MulticastFacts
    ports: tuple[PortFacts, ...]
    firewall: FirewallFacts
    keyring: KeyringFacts
    disk: DiskFacts
    clock: ClockFacts


CLOCK_FAIL_S = 300.0  # engine.trust.fleet_ca.CLOCK_SKEW: certificates start 5 min early, no more
CLOCK_WARN_S = 60.0
RENDER_GROUP_FIX = ("add yourself to the render group: sudo usermod -aG render $USER, then log out and "
                    "in again")


def _gb(n: float) -> str:
    return f"{n / 2**30:.1f} GB"


def _accelerator(kind: str, d: DeviceFacts, *, present: bool, nodes: tuple[str, ...], node_dir: str,
                 kernel_fix: str, userspace: bool, userspace_fix: str) -> Finding:
    """Why OpenVINO does not list a GPU or NPU this PC has: no kernel driver (no device node), no
    permission on the node, or no user-space driver. Only Linux can tell the three apart."""
    name = f"{kind} visible to OpenVINO"
    if any(dev.split(".")[0] == kind for dev in d.devices):
        return Finding(name, Status.OK, f"{kind}: {', '.join(x for x in d.devices if x.startswith(kind))}")
    if not d.platform.startswith("linux"):
        return Finding(name, Status.WARN, f"OpenVINO lists no {kind}",
                       f"if this PC has an Intel {kind}, install or update its driver from Intel, then reboot")
    if not present:
        return Finding(name, Status.OK, f"no Intel {kind} on this PC (nothing to lend there)")
    if not nodes:
        return Finding(name, Status.FAIL, f"this PC has an Intel {kind} but {node_dir} is absent: its kernel "
                       "driver is not loaded", kernel_fix)
    denied = [n for n in nodes if not d.node_access.get(n, False)]
    if len(denied) == len(nodes):
        if d.in_render_group is False:
            return Finding(name, Status.FAIL, f"{', '.join(denied)} is not accessible: you are not in the "
                           "render group", RENDER_GROUP_FIX)
        return Finding(name, Status.FAIL, f"{', '.join(denied)} is not readable and writable by you",
                       f"give the render group read/write on {node_dir} (a udev rule) and join that group")
    if not userspace:
        return Finding(name, Status.FAIL, f"the {kind}'s device node exists but its user-space driver is "
                       "missing", userspace_fix)
    return Finding(name, Status.WARN, f"the {kind} looks usable but OpenVINO does not list it",
                   f"run `python -c \"import openvino; print(openvino.Core().available_devices)\"` and check "
                   f"the {kind} driver's version against OpenVINO's system requirements")


def check_devices(d: DeviceFacts) -> list[Finding]:
    if d.openvino_error is not None:
        return [Finding("OpenVINO", Status.FAIL, f"OpenVINO does not start: {d.openvino_error}",
                        "reinstall the agent (its OpenVINO runtime is damaged or missing)")]
    found = [Finding("OpenVINO", Status.OK, f"devices: {', '.join(d.devices) or 'none'}")]
    if "CPU" not in d.devices:
        found.append(Finding("CPU visible to OpenVINO", Status.FAIL, "OpenVINO lists no CPU",
                             "this CPU may be unsupported (OpenVINO needs x86-64 with SSE4.2 or ARM64)"))
    found.append(_accelerator(
        "GPU", d, present=d.intel_gpu_pci, nodes=d.render_nodes, node_dir="/dev/dri",
        kernel_fix="use a kernel with the i915 or xe driver for this GPU (or load it: sudo modprobe i915)",
        userspace=bool(d.opencl_icds),
        userspace_fix="install Intel's GPU compute runtime (Debian/Ubuntu: sudo apt install intel-opencl-icd)"))
    found.append(_accelerator(
        "NPU", d, present=d.intel_npu_pci, nodes=d.accel_nodes, node_dir="/dev/accel",
        kernel_fix="the NPU needs Linux 6.3 or newer with the intel_vpu driver (sudo modprobe intel_vpu)",
        userspace=d.npu_userspace,
        userspace_fix="install Intel's NPU driver (linux-npu-driver: intel-level-zero-npu and "
                      "intel-driver-compiler-npu)"))
    return found


def check_multicast(m: MulticastFacts) -> Finding:
    name = f"mDNS discovery on {m.interface}"
    if m.error is None and m.seconds is not None:
        return Finding(name, Status.OK, f"a test service was announced and found again in {m.seconds:.1f} s "
                       "(this PC's side only; the network's switches can still drop multicast)")
    return Finding(name, Status.FAIL, f"mDNS does not work here: {m.error or 'the test service was not found'}",
                   "allow UDP 5353 (multicast 224.0.0.251) on this interface, or pick the right one with "
                   "--interface; where the network drops multicast, give the agent the console's address "
                   "with --seed HOST:PORT")


def check_port(p: PortFacts) -> Finding:
    name = f"{p.name} port {p.port} on {p.interface}"
    if p.bind_error is None and p.connect_error is None:
        return Finding(name, Status.OK, "free, and a connection to it gets through")
    if p.in_use and p.held_by_agent:
        return Finding(name, Status.OK, f"in use by the running Deskfleet agent ({p.holder})")
    if p.in_use:
        holder = f" by {p.holder}" if p.holder else ""
        return Finding(name, Status.FAIL, f"already in use{holder}",
                       f"stop that program, or give the agent another port: deskfleet agent --{p.name}-port N")
    if p.bind_error is not None:
        return Finding(name, Status.FAIL, f"cannot listen there: {p.bind_error}",
                       "check the interface address (--interface) and that the port is allowed for you")
    return Finding(name, Status.FAIL, f"listening works but connecting is refused: {p.connect_error}",
                   f"a local firewall drops the port: allow TCP {p.port} in")


def check_firewall(f: FirewallFacts, ports: tuple[int, ...]) -> Finding:
    tcp = ",".join(str(p) for p in ports if p)
    if f.ufw_active:
        return Finding("firewall", Status.WARN, "ufw is active: other PCs may not reach the agent",
                       f"sudo ufw allow proto tcp to any port {tcp} && sudo ufw allow 5353/udp")
    if f.firewalld_running:
        adds = " ".join(f"--add-port={p}/tcp" for p in ports if p)
        return Finding("firewall", Status.WARN, "firewalld is running: other PCs may not reach the agent",
                       f"sudo firewall-cmd --permanent {adds} --add-service=mdns && sudo firewall-cmd --reload")
    if f.ufw_active is None and f.firewalld_running is None:
        return Finding("firewall", Status.SKIP, "no host firewall this check knows (ufw, firewalld) was found")
    return Finding("firewall", Status.OK, "no host firewall is active")


def check_keyring(k: KeyringFacts) -> Finding:
    where = f"{k.backend}" + (f" at {k.location}" if k.location else "")
    if k.error is None:
        note = " (no OS keyring here: a 0600 file stands in)" if k.file_backend else ""
        return Finding("keyring", Status.OK, f"secrets go to {where}{note}")
    if k.file_backend:
        return Finding("keyring", Status.FAIL, f"the file keyring {k.location} is not writable: {k.error}",
                       "make that directory writable for you, or set DESKFLEET_KEYRING_DIR to a directory "
                       "that is")
    return Finding("keyring", Status.FAIL, f"the OS keyring ({k.backend}) refused a test secret: {k.error}",
                   "unlock the keyring (log in to the desktop session once), then run doctor again")


def check_disk(d: DiskFacts) -> Finding:
    name = f"disk space for shards ({d.path})"
    if d.free_bytes >= d.need_bytes:
        return Finding(name, Status.OK, f"{_gb(d.free_bytes)} free (at least {_gb(d.need_bytes)} wanted)")
    return Finding(name, Status.FAIL, f"only {_gb(d.free_bytes)} free; a shard and its compiled cache need "
                   f"{_gb(d.need_bytes)}", "free space on that disk, or move the agent's state to a larger one "
                   "(deskfleet agent --state-dir DIR)")


def check_clock(c: ClockFacts) -> Finding:
    if c.console is None:
        return Finding("clock", Status.SKIP, "not compared: give the console's address (--console HOST:PORT) "
                       "to compare this PC's clock with it")
    name = f"clock against the console at {c.console}"
    if c.error is not None or c.skew_s is None:
        return Finding(name, Status.FAIL, f"cannot read the console's time: {c.error or 'no Date header'}",
                       "check the console address (the enrollment address shown next to the token) and "
                       "that the console is running")
    ahead = "behind" if c.skew_s > 0 else "ahead of"
    text = f"this PC's clock is {abs(c.skew_s):.0f} s {ahead} the console's"
    fix = ("turn on network time: sudo timedatectl set-ntp true (Linux), w32tm /resync (Windows), or "
           "Date & Time settings")
    if abs(c.skew_s) > CLOCK_FAIL_S:
        return Finding(name, Status.FAIL, f"{text}: fleet certificates will look not yet valid or expired", fix)
    if abs(c.skew_s) > CLOCK_WARN_S:
        return Finding(name, Status.WARN, text, fix)
    return Finding(name, Status.OK, text)


def diagnose(f: Facts) -> list[Finding]:
    """Every check over ``f``, in the order a person would fix them."""
    return [*check_devices(f.devices), check_multicast(f.multicast), *(check_port(p) for p in f.ports),
            check_firewall(f.firewall, tuple(p.port for p in f.ports)), check_keyring(f.keyring),
            check_disk(f.disk), check_clock(f.clock)]


def exit_code(findings: list[Finding]) -> int:
    return 1 if any(x.status is Status.FAIL for x in findings) else 0


def report(findings: list[Finding]) -> str:
    lines = []
    for x in findings:
        lines.append(f"  {x.status.value:<4}  {x.check}: {x.summary}")
        if x.fix and x.status in (Status.FAIL, Status.WARN):
            lines.append(f"        fix: {x.fix}")
    failed = sum(x.status is Status.FAIL for x in findings)
    lines.append(f"{failed} problem{'s' if failed != 1 else ''} found." if failed else "No problems found.")
    return "\n".join(lines)
