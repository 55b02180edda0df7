"""The I/O half of ``deskfleet doctor``: gather the facts :mod:`engine.doctor.checks` judges.

Each gatherer turns whatever goes wrong into a fact (an error string), never an exception, so
one broken subsystem cannot hide the others. Linux facts are read from ``root`` (``/`` unless
a test points it at a fake tree); mDNS only ever binds the one interface it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes.util
import email.utils
import errno
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import keyring.errors
import psutil
from zeroconf import ServiceInfo
from zeroconf.asyncio import AsyncServiceInfo

from engine.control.enrollment import split_address
from engine.discovery.mdns import _zeroconf_on
from engine.doctor.checks import (
    ClockFacts,
    DeviceFacts,
    DiskFacts,
    FirewallFacts,
    KeyringFacts,
    MulticastFacts,
    PortFacts,
)
from engine.errors import DiscoveryError, EnrollmentError
from engine.suppress import logged_suppress
from engine.trust.keystore import SERVICE, FileKeyring, default_backend

log = logging.getLogger(__name__)

INTEL_VENDOR = "0x8086"
_DISPLAY_CLASS = "0x03"  # PCI base class 03: display controllers
_ACCEL_CLASS = "0x12"  # PCI base class 12: processing accelerators (Intel's NPU)
SELFTEST_TYPE = "_deskfleet-dr._tcp.local."  # never browsed by agents or consoles


def _read(path: Path) -> str:
    try:
        return path.read_text().strip().lower()
    except OSError:
        return ""


def _intel_pci(root: Path, class_prefix: str) -> bool:
    for device in sorted((root / "sys/bus/pci/devices").glob("*")):
        if _read(device / "vendor") == INTEL_VENDOR and _read(device / "class").startswith(class_prefix):
            return True
    return False


def _intel_nodes(root: Path, dev_glob: str, sys_class: str) -> tuple[str, ...]:
    """Device nodes whose sysfs entry says the device is Intel's (paths as seen from ``root``)."""
    nodes = []
    for node in sorted((root / "dev").glob(dev_glob)):
        if _read(root / "sys/class" / sys_class / node.name / "device/vendor") == INTEL_VENDOR:
            nodes.append(str(node))
    return tuple(nodes)


def _in_render_group() -> bool | None:
    try:
        import grp  # POSIX only

        gid = grp.getgrnam("render").gr_gid
    except (ImportError, KeyError):
        return None
    return gid in os.getgroups() or gid == os.getgid()


def _npu_userspace(root: Path) -> bool:
    if root == Path("/") and ctypes.util.find_library("ze_intel_vpu"):
        return True
    return any(any((root / lib).glob("libze_intel_vpu.so*"))
               for lib in ("usr/lib", "usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/local/lib"))


def gather_devices(*, root: Path = Path("/"), core=None, platform: str = sys.platform) -> DeviceFacts:
    """OpenVINO's devices (``core``: an ``openvino.Core``, created when None) and, on Linux, the
    PCI devices, device nodes, permissions and drivers that explain a missing GPU or NPU."""
    devices: tuple[str, ...] = ()
    error = None
    try:
        if core is None:
            import openvino  # here, inside the try: an OpenVINO that fails to load is itself the finding

            core = openvino.Core()
        devices = tuple(core.available_devices)
    except Exception as exc:  # a broken runtime is itself the finding
        error = f"{type(exc).__name__}: {exc}"
    if not platform.startswith("linux"):
        return DeviceFacts(platform=platform, devices=devices, openvino_error=error)
    render = _intel_nodes(root, "dri/renderD*", "drm")
    accel = _intel_nodes(root, "accel/accel*", "accel")
    return DeviceFacts(
        platform=platform, devices=devices, openvino_error=error,
        intel_gpu_pci=_intel_pci(root, _DISPLAY_CLASS), intel_npu_pci=_intel_pci(root, _ACCEL_CLASS),
        render_nodes=render, accel_nodes=accel,
        node_access={n: os.access(n, os.R_OK | os.W_OK) for n in render + accel},
        in_render_group=_in_render_group(),
        opencl_icds=tuple(str(p) for p in sorted((root / "etc/OpenCL/vendors").glob("*.icd"))),
        npu_userspace=_npu_userspace(root))


async def async_multicast_selftest(interface: str, *, timeout: float = 8.0) -> MulticastFacts:
    """Announce a throwaway service on ``interface`` from one zeroconf instance and resolve it from
    a second one: mDNS sockets, multicast loop and this host's filters, not the switches."""
    start = time.monotonic()
    name = f"doctor-{secrets.token_hex(4)}.{SELFTEST_TYPE}"
    publisher = finder = None
    try:
        publisher = _zeroconf_on(interface)
        finder = _zeroconf_on(interface)
        info = ServiceInfo(SELFTEST_TYPE, name, port=9, properties={"t": "1"}, parsed_addresses=[interface],
                           server=name, host_ttl=30, other_ttl=30)
        async with asyncio.timeout(timeout):
            await (await publisher.async_register_service(info))
            found = AsyncServiceInfo(SELFTEST_TYPE, name)
            while not await found.async_request(finder.zeroconf, 1000):
                pass
        seconds = time.monotonic() - start
        await asyncio.wait_for(await publisher.async_unregister_service(info), timeout)
        return MulticastFacts(interface, seconds=seconds)
    except TimeoutError:
        return MulticastFacts(interface, error=f"the test service was not seen within {timeout:g} s")
    except (DiscoveryError, OSError) as exc:
        return MulticastFacts(interface, error=str(exc))
    finally:
        for zc in (finder, publisher):
            if zc is not None:
                await zc.async_close()


def _holder(port: int) -> tuple[str | None, bool]:
    """Who listens on TCP ``port`` ("name (pid N)") and whether it is a Deskfleet agent."""
    # another user's process, or no permission to list sockets: nobody known
    with logged_suppress(log, f"finding who listens on TCP port {port}"):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                proc = psutil.Process(conn.pid)
                cmdline = " ".join(proc.cmdline())
                agent = " agent" in cmdline and ("deskfleet" in cmdline or "engine.cli.main" in cmdline)
                return f"{proc.name()} (pid {conn.pid})", agent
    return None, False


def probe_port(name: str, interface: str, port: int, *, timeout: float = 3.0) -> PortFacts:
    """Listen on ``interface:port`` as the agent would, then connect to it from this host."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if os.name != "nt":  # as the agent's server does; TIME_WAIT leftovers must not count as "in use"
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((interface, port))
            server.listen(1)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                holder, agent = _holder(port)
                return PortFacts(name, interface, port, bind_error=exc.strerror or str(exc), in_use=True,
                                 holder=holder, held_by_agent=agent)
            return PortFacts(name, interface, port, bind_error=exc.strerror or str(exc))
        bound = server.getsockname()[1]
        try:
            with socket.create_connection((interface, bound), timeout=timeout):
                server.settimeout(timeout)
                server.accept()[0].close()
        except OSError as exc:
            return PortFacts(name, interface, port, connect_error=str(exc))
        return PortFacts(name, interface, port)
    finally:
        server.close()


def gather_firewall(*, root: Path = Path("/"), platform: str = sys.platform) -> FirewallFacts:
    if not platform.startswith("linux"):
        return FirewallFacts()
    ufw = None
    conf = root / "etc/ufw/ufw.conf"
    if conf.is_file():
        ufw = any(line.strip().lower() == "enabled=yes" for line in _read(conf).splitlines())
    firewalld = None
    if root == Path("/") and shutil.which("firewall-cmd"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            state = subprocess.run(["firewall-cmd", "--state"], capture_output=True, text=True, timeout=5)
            firewalld = state.stdout.strip() == "running"
    return FirewallFacts(ufw_active=ufw, firewalld_running=firewalld)


def probe_keyring(backend=None) -> KeyringFacts:
    """Write, read back and delete a probe secret in the backend the agent would use."""
    try:
        backend = backend if backend is not None else default_backend()
    except Exception as exc:
        return KeyringFacts("none", False, error=f"no keyring backend loads: {exc}")
    is_file = isinstance(backend, FileKeyring)
    location = str(backend.path.parent) if is_file else None
    label = f"{type(backend).__module__}.{type(backend).__name__}"
    user, value = f"doctor-probe/{secrets.token_hex(4)}", secrets.token_hex(8)
    try:
        backend.set_password(SERVICE, user, value)
        try:
            if backend.get_password(SERVICE, user) != value:
                return KeyringFacts(label, is_file, location, error="a test secret did not read back")
        finally:
            backend.delete_password(SERVICE, user)
    except (keyring.errors.KeyringError, OSError) as exc:
        return KeyringFacts(label, is_file, location, error=str(exc))
    return KeyringFacts(label, is_file, location)


def gather_disk(path: Path, need_bytes: int) -> DiskFacts:
    existing = path.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return DiskFacts(str(path), shutil.disk_usage(existing).free, need_bytes)


async def async_console_clock(console: str | None, *, timeout: float = 5.0) -> ClockFacts:
    """The console's clock (its HTTP Date header, from the enrollment endpoint) minus ours."""
    if console is None:
        return ClockFacts(None)
    try:
        host, port = split_address(console)
    except EnrollmentError as exc:
        return ClockFacts(console, error=str(exc))
    base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            before = time.time()
            async with session.get(f"{base}/v1/ca", ssl=False) as resp:  # the Date header is all we read
                after = time.time()
                date = resp.headers.get("Date")
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return ClockFacts(console, error=str(exc) or type(exc).__name__)
    if date is None:
        return ClockFacts(console, error="the console's answer has no Date header")
    try:
        theirs = email.utils.parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError):
        return ClockFacts(console, error=f"unreadable Date header {date!r}")
    # The header has 1 s resolution and is stamped between our send and receive: compare with the middle.
    return ClockFacts(console, skew_s=theirs + 0.5 - (before + after) / 2)
