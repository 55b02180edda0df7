"""The emulated office: desk PCs running ``deskfleet agent --headless``, a server PC running
``deskfleet fleet``, and a PC the people's clients run on, all real processes on one bridge.

    with building(OfficeSpec(desks=(PcSpec("desk-1", 0.5, 1536), ...)), root) as pcs:
        async with Office(pcs, root) as office:
            admin = await office.async_start_fleet()
            agents = await office.async_enrol()          # joined over mDNS, approved
            ring = await office.async_place(export, [office.desks[0]])

:func:`building` makes the machines (namespaces, cgroups, displays, cables) and removes all of it
on exit, also after a failure; :func:`sweep_stale` first removes what a crashed earlier run left
(every name carries its creator's pid); :func:`leftovers` lists what of a run is still there (a
test asserts it is nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.fleet import netns
from tests.fleet.netns import namespaces
from tests.fleet_service.admin import Admin
from tests.support.office import display as display_mod
from tests.support.office import share as share_mod
from tests.support.office.display import start_xvfb, stop_xvfb
from tests.support.office.link import shape
from tests.support.office.pc import Pc, PcSpec
from tests.support.office.share import Group, assign_cpus
from tests.support.service_process import ServiceProcess

PREFIX = "dfo"  # every namespace, link and cgroup of an office run: dfo<pid>...
SUBNET = "10.231.78"
REPO = Path(__file__).resolve().parents[3]
CONTROL_PORT, DATA_PORT = 7210, 7211  # each PC has its own network: the installed defaults
AGENT_STOP_S = 20.0
# A desk's agent: no warm spare (in a memory-limited PC it would double the stage; the agent sees its
# cgroup's limit and would keep none, but the office does not rely on it) and a small KV pool (preallocated per stage)
AGENT_DEFAULTS: dict[str, Any] = {"warm_spare": "off", "kv_pool_mb": 64}
_serial = itertools.count(1)


class OfficeError(RuntimeError):
    """The office could not be built or did not come up (what and where to look is in the message)."""


@dataclass(frozen=True)
class OfficeSpec:
    """The desks (one agent each), the server (the fleet service) and the people's PC (clients)."""

    desks: tuple[PcSpec, ...]
    server: PcSpec = PcSpec("server", cores=1.0, display=False)
    people: PcSpec = PcSpec("people", cores=1.0, display=False)

    @property
    def all(self) -> tuple[PcSpec, ...]:
        return (self.server, self.people, *self.desks)


def why_unavailable(spec: OfficeSpec | None = None) -> str | None:
    """None when an office can be built here, else what is missing (root, netns, a cgroup v1
    controller, nsenter/tc, Xvfb/xdotool for desks with a display)."""
    reason = netns.why_unavailable() or share_mod.why_unavailable()
    if reason is None:
        for tool, package in (("nsenter", "util-linux"), ("tc", "iproute2")):
            if shutil.which(tool) is None:
                return f"{tool} is not installed ({package})"
    if reason is None and (spec is None or any(d.display for d in spec.all)):
        reason = display_mod.why_unavailable()
    return reason


def sweep_stale() -> list[str]:
    """Remove the namespaces, links and cgroups (and what runs in them) of earlier runs whose process is gone."""
    return netns.sweep_stale(PREFIX) + [str(p) for p in share_mod.sweep_stale(PREFIX)]


def leftovers(pid: int | None = None) -> list[str]:
    """What of the run of process ``pid`` (default: this one) is still on the machine: namespaces,
    links, cgroups, and processes in them."""
    pid = os.getpid() if pid is None else pid
    tag = f"{PREFIX}{pid}"
    found = [f"netns {line.split()[0]}" for line in
             subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout.splitlines()
             if line.startswith(tag + "h")]
    for line in subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                               timeout=10).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name == f"{PREFIX}br{pid}" or name.startswith(f"{PREFIX}v{pid}h"):
            found.append(f"link {name}")
    for controller in (*share_mod.CONTROLLERS, "cpuacct"):
        parent = share_mod.own_group(controller)
        if parent.is_dir():
            found += [f"cgroup {p}" for p in parent.iterdir() if p.is_dir() and p.name.startswith(tag + "-")]
    return found


@contextlib.contextmanager
def building(spec: OfficeSpec, root: Path) -> Iterator[list[Pc]]:
    """The office's machines, in ``spec.all`` order (server, people, desks); all removed on exit."""
    reason = why_unavailable(spec)
    if reason is not None:
        raise OfficeError(f"cannot build an office here: {reason}")
    sweep_stale()
    specs = spec.all
    if len({s.name for s in specs}) != len(specs):
        raise OfficeError(f"PC names must differ: {[s.name for s in specs]}")
    cpus = assign_cpus([s.share for s in specs])
    run = next(_serial)
    with contextlib.ExitStack() as stack:
        hosts = stack.enter_context(namespaces(len(specs), subnet=SUBNET, prefix=PREFIX))
        pcs = []
        for s, host, cpu in zip(specs, hosts, cpus, strict=True):
            pc_root = root / s.name
            pc_root.mkdir(parents=True, exist_ok=True)
            group = Group(f"{PREFIX}{os.getpid()}-{run}{s.name}", s.share, cpu)
            stack.callback(group.remove)  # registered first: it runs last, and kills whatever is left in the PC
            group.create()
            shown = None
            if s.display:
                proc, shown = start_xvfb(pc_root / "xvfb.log", group.preexec())
                stack.callback(stop_xvfb, proc)
            if s.cable_mbit is not None:
                shape(host, s.cable_mbit)
            pcs.append(Pc(s, host, group, shown, pc_root))
        yield pcs


@dataclass
class Office:
    """The fleet running on ``pcs`` (from :func:`building`): its service, agents and what they serve."""

    pcs: list[Pc]
    root: Path
    service: ServiceProcess | None = None
    admin: Admin | None = None
    agents: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def server(self) -> Pc:
        return self.pcs[0]

    @property
    def people(self) -> Pc:
        return self.pcs[1]

    @property
    def desks(self) -> list[Pc]:
        return self.pcs[2:]

    def desk(self, name: str) -> Pc:
        return next(pc for pc in self.desks if pc.name == name)

    async def __aenter__(self) -> Office:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.async_close()

    async def async_start_fleet(self, *, exact: bool = True, timeout: float = 120.0) -> Admin:
        """``deskfleet fleet`` on the server PC (workers' threads: each PC's own cores decide)."""
        state = self.server.root / "fleet"
        (state / "exports").mkdir(parents=True, exist_ok=True)
        self.service = ServiceProcess(state, self.server.root / "fleet.log", interface=self.server.address,
                                      threads=None, exact=exact, launch=self.server.argv,
                                      preexec=self.server.group.preexec())
        self.admin = await self.service.start(timeout=timeout)
        return self.admin

    def start_agent(self, pc: Pc, token: str, **settings: Any) -> subprocess.Popen:
        """``deskfleet agent --headless`` on ``pc`` with a join token; it finds the fleet over mDNS.
        ``settings``: AgentSettings fields over the office's defaults (:data:`AGENT_DEFAULTS`), e.g.
        ``resume_after_idle_s=5`` for a day of people coming and going."""
        from agent.service.settings import AgentSettings, save_settings
        from engine.control.fleet_services import write_token_file

        state = pc.root / "agent"
        state.mkdir(parents=True, exist_ok=True)
        # each namespace shares the machine's host name: the agent's name is the PC's
        save_settings(state, AgentSettings(name=pc.name, **{**AGENT_DEFAULTS, **settings}))
        token_file = write_token_file(pc.root / "join-token", token)
        argv = [sys.executable, "-m", "engine.cli.main", "agent", "--headless", "--state-dir", str(state),
                "--interface", pc.address, "--control-port", str(CONTROL_PORT), "--data-port", str(DATA_PORT),
                "--join-file", str(token_file)]
        proc = pc.popen(argv, pc.root / "agent.log", cwd=REPO,
                        env={"DESKFLEET_KEYRING_DIR": str(pc.root / "keyring")})
        self.agents[pc.name] = proc
        return proc

    async def async_enrol(self, desks: Sequence[Pc] | None = None, *, timeout: float = 120.0,
                          **settings: Any) -> dict[str, dict]:
        """Start an agent on each desk with its own join token, wait until the service has found every
        one (over mDNS), approve them; the agents' records by PC name."""
        assert self.admin is not None, "start the fleet first"
        desks = list(self.desks if desks is None else desks)
        for pc in desks:
            token = (await self.admin.ok("POST", "/tokens", {}))["token"]
            self.start_agent(pc, token, **settings)
        found: dict[str, dict] = {}
        deadline = asyncio.get_running_loop().time() + timeout
        while len(found) < len(desks):
            self._check_agents_alive()
            for a in (await self.admin.ok("GET", "/agents"))["agents"]:
                if a["name"] in {pc.name for pc in desks} and a["verified"] and a["node_id"]:
                    found[a["name"]] = a
            if asyncio.get_running_loop().time() > deadline:
                missing = sorted({pc.name for pc in desks} - set(found))
                raise OfficeError(f"the fleet did not find {missing} in {timeout:g} s (logs under {self.root})")
            await asyncio.sleep(0.5)
        for name, a in found.items():
            await self.admin.ok("POST", f"/agents/{a['key']}/approve")
            found[name] = a
        return found

    def _check_agents_alive(self) -> None:
        for name, proc in self.agents.items():
            if proc.poll() is not None:
                log = (self.desk(name).root / "agent.log").read_text(errors="replace")[-3000:]
                raise OfficeError(f"the agent on {name} exited {proc.returncode}:\n{log}")

    async def async_agent(self, name: str) -> dict:
        assert self.admin is not None
        for a in (await self.admin.ok("GET", "/agents"))["agents"]:
            if a["name"] == name:
                return a
        raise OfficeError(f"the fleet has no agent {name!r}")

    async def async_place(self, export: Path, desks: Sequence[Pc], *, standby: Sequence[Pc] | None = None,
                          timeout: float = 600.0) -> dict[str, Any]:
        """Serve ``export`` as one ring with stage i on ``desks[i]`` (the export is copied into the
        fleet's library first); the ring's record once it serves. ``standby``: the PCs standing by for
        it (None: the service's default, every approved agent in no ring)."""
        from engine.shards.manifest import load_manifest

        assert self.admin is not None and self.service is not None
        stages = load_manifest(export).stages
        if len(stages) != len(desks):
            raise OfficeError(f"{export.name} has {len(stages)} stages; {len(desks)} desks given")
        library = self.service.state / "exports" / export.name
        if not library.exists():
            shutil.copytree(export, library)
        agents = {a["name"]: a for a in (await self.admin.ok("GET", "/agents"))["agents"]}
        plan = {"stages": [{"device_id": f"{agents[pc.name]['node_id']}/CPU", "pc_id": agents[pc.name]["node_id"],
                            "first_layer": st.first_layer, "last_layer": st.last_layer}
                           for pc, st in zip(desks, stages, strict=True)]}
        body: dict[str, Any] = {"plan": plan, "export_id": export.name}
        if standby is not None:
            body["standby"] = [agents[pc.name]["node_id"] for pc in standby]
        made = await self.admin.ok("POST", "/rings", body)
        job = await self.admin.job(made["job"]["id"], timeout)
        if job["state"] != "done":
            raise OfficeError(f"the ring on {[pc.name for pc in desks]} did not come up: {job}")
        return (await self.admin.ok("GET", f"/rings/{made['ring']['ring']}"))["ring"]

    async def async_add_model(self, checkpoint: Path) -> str:
        """Add ``checkpoint`` (a directory the server PC can read) to the fleet's library; its name."""
        assert self.admin is not None
        return (await self.admin.ok("POST", "/models", {"path": str(checkpoint)}))["model"]["name"]

    async def async_placement(self, model: str, *, context: int | None = None, request: dict | None = None,
                              timeout: float = 1800.0) -> dict[str, Any]:
        """The fleet service's placement of ``model`` over the approved agents (measured, calibrated and
        solved by the service: ``POST /placements``); its JSON (id, inputs, plan)."""
        assert self.admin is not None
        made = await self.admin.ok("POST", "/placements", {"model": model, "context": context,
                                                           "request": request or {}})
        job = await self.admin.job(made["job"]["id"], timeout)
        if job["state"] != "done":
            raise OfficeError(f"the placement of {model} failed: {job.get('error') or job}")
        return job["result"]["placement"]

    async def async_serve_plan(self, model: str, plan: dict[str, Any], spec: dict[str, Any] | None = None, *,
                               timeout: float = 1800.0) -> dict[str, Any]:
        """Serve ``model`` as one ring with ``plan`` (a placement's), exported by the service with its split;
        the ring's record once it serves."""
        assert self.admin is not None
        made = await self.admin.ok("POST", "/rings", {"plan": plan, "model": model, "spec": spec or {}, "standby": []})
        job = await self.admin.job(made["job"]["id"], timeout)
        if job["state"] != "done":
            raise OfficeError(f"the ring of {model} did not come up: {job.get('error') or job}")
        return (await self.admin.ok("GET", f"/rings/{made['ring']['ring']}"))["ring"]

    async def async_stop_rings(self, *, timeout: float = 60.0) -> None:
        """``DELETE`` every ring the fleet serves (their workers stop) and wait until no agent serves."""
        assert self.admin is not None
        for ring in (await self.admin.ok("GET", "/rings"))["rings"]:
            await self.admin.ok("DELETE", f"/rings/{ring['ring']}", timeout=timeout)
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            await self.admin.call("POST", "/agents/refresh")
            busy = [a["name"] for a in (await self.admin.ok("GET", "/agents"))["agents"]
                    if a["state"] in ("serving", "fetching")]
            if not busy:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise OfficeError(f"agents still serving {timeout:g} s after their rings were stopped: {busy}")
            await asyncio.sleep(0.5)

    async def async_api(self) -> tuple[str, str, Path]:
        """The fleet's OpenAI API base URL, a key for it and the fleet CA its HTTPS certificate is under."""
        from engine.control.fleet_services import CA_CERT

        assert self.admin is not None and self.service is not None
        url = (await self.admin.ok("GET", "/service"))["api_url"]
        key = (await self.admin.ok("POST", "/keys/console/secret"))["secret"]
        return url, key, self.service.state / CA_CERT

    async def async_close(self) -> None:
        """Stop the agents (SIGTERM, then SIGKILL) and the service; the PCs' cgroups mop up the rest."""
        for proc in self.agents.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.agents.values():
            try:
                await asyncio.to_thread(proc.wait, AGENT_STOP_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait, 10)
        if self.admin is not None:
            await self.admin.close()
            self.admin = None
        if self.service is not None:
            await self.service.stop()
