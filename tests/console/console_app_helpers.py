"""Drive the admin console the way an admin does, through its pages' widgets, against a real
local fleet: a `FleetService` on a loop thread of its own (the service's PC), the console (its
`ServiceBridge` over the service's admin socket + the window) and headless `AgentService`s on
127.0.0.1, each with its own state dir. Shared by tests/console/test_console_app.py (pytest-qt, offscreen) and
tests/console/console_screenshots.py (under Xvfb): ``wait(condition, timeout_s, what)`` is the only
thing they supply differently.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox

from agent.service.service import AgentService
from agent.service.settings import AgentSettings
from console.fleet.fleet_service import FleetService, FleetServiceSettings
from console.fleet_api.fleet_settings import FleetSettings
from console.qt.main_window import QtConsoleWindow
from console.qt.service_bridge import ServiceBridge
from console.shared.loop_thread import LoopThread
from engine.control.messages import WorkerSettings
from engine.shards.kv_precision import KV_BYTES_PER_VALUE
from tests.support.agent_helpers import FakeIdle

Wait = Callable[[Callable[[], bool], float, str], None]
# Names of their own: other test runs on this machine may advertise a "desk-a" on loopback too.
SUFFIX = uuid.uuid4().hex[:4]
NAMES = (f"desk-a-{SUFFIX}", f"desk-b-{SUFFIX}")
CHAT_OPTIONS = {"temperature": 0, "max_tokens": 16}


def console_settings(state_dir: Path) -> FleetSettings:
    """Everything on loopback with OS-chosen ports; one thread per stage worker."""
    return FleetSettings(state_dir=state_dir, interface="127.0.0.1", api_port=0, enrollment_port=0, hub_port=0,
                           data_port=0, worker=WorkerSettings(threads=1), refresh_s=1.0, metrics_s=0.25,
                           calibration_steps=4, admin_port=None)


@dataclass
class RunningService:
    """A started fleet service and the loop thread it runs on (read its loop objects through ``loop``)."""

    loop: LoopThread
    service: FleetService
    state_dir: Path


@contextlib.contextmanager
def fleet_service(state_dir: Path, runtime: str | None = None) -> Iterator[RunningService]:
    """A started fleet service over ``state_dir`` (mDNS browsing on loopback, the admin API on its
    local socket only) on a loop thread of its own, as if on the service's PC; closed after with
    its workers stopped. ``runtime``: the rings' runtime, if not the settings' default."""
    console = console_settings(state_dir)
    if runtime is not None:
        console = dataclasses.replace(console, runtime=runtime)
    settings = FleetServiceSettings(console, admin_port=None, advertise_api=False)
    with LoopThread("test-fleet-service") as loop, _warm_executor(loop):
        service = loop.run(FleetService.async_open(settings), 120, "starting the fleet service")
        try:
            yield RunningService(loop, service, state_dir)
        finally:
            loop.run(service.async_close(stop_workers=True), 120, "stopping the fleet service")


@contextlib.contextmanager
def _warm_executor(loop: LoopThread, workers: int = 8) -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    """The loop's default executor with every thread started now: a service shared by a module's
    tests then starts no thread during a test (which the leaked-thread check would count)."""
    executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="test-fleet-service-executor")
    barrier = threading.Barrier(workers)
    for future in [executor.submit(barrier.wait, 30) for _ in range(workers)]:
        future.result(60)

    async def install() -> None:
        asyncio.get_running_loop().set_default_executor(executor)

    loop.run(install(), 10, "installing the executor")
    try:
        yield executor
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def running_console(state_dir: Path, wait: Wait, service: RunningService | None = None) -> Iterator[QtConsoleWindow]:
    """A console attached over the local socket to ``service`` (None: one started over
    ``state_dir`` for this console alone); detached after, which stops nothing."""
    with contextlib.ExitStack() as stack:
        bridge = ServiceBridge(console_settings(state_dir if service is None else service.state_dir))
        window = QtConsoleWindow(bridge, chat_options=CHAT_OPTIONS)
        try:
            if service is None:  # after the bridge: it tells a first start (no fleet CA yet) as the real one does
                service = stack.enter_context(fleet_service(state_dir))
            bridge.start()
            wait(lambda: bridge.running, 60, "the console to attach to the fleet service")
            assert not bridge.started_service, "the console started a fleet service of its own"
            yield window
        finally:
            window.shutdown()
            bridge.close()
            window.close()
            window.deleteLater()


@contextlib.contextmanager
def local_agents(root: Path, names: tuple[str, ...] = NAMES) -> Iterator[tuple[LoopThread, dict[str, AgentService]]]:
    """Started, not yet joined agents on a loop thread of their own (as if on other PCs)."""
    with LoopThread("test-agents") as loop:
        agents: dict[str, AgentService] = {}
        try:
            for name in names:
                settings = AgentSettings(name=name, interface="127.0.0.1", control_port=0, data_port=0)
                agents[name] = AgentService(root / name, settings, idle_source=FakeIdle(1e6), power=lambda: None)
                loop.run(agents[name].async_start(), 120, f"starting {name}")
            yield loop, agents
        finally:
            for agent in agents.values():
                loop.run(agent.async_close(), 60, "stopping an agent")


@dataclass
class ConsoleDriver:
    window: QtConsoleWindow
    wait: Wait

    @property
    def bridge(self) -> ServiceBridge:
        return self.window.bridge

    # -- Fleet page ----------------------------------------------------------------------------------

    def fleet_rows(self) -> dict[str, dict[str, str]]:
        """The Fleet table as {agent name: {column: text}}."""
        model, rows = self.window.fleet_page.table.model(), {}
        headers = [model.headerData(c, Qt.Orientation.Horizontal) for c in range(model.columnCount())]
        for r in range(model.rowCount()):
            cells = {h: model.index(r, c).data() or "" for c, h in enumerate(headers)}
            rows[cells["Name"]] = cells
        return rows

    def wait_rows(self, names, predicate: Callable[[dict[str, str]], bool], what: str, timeout: float = 30) -> None:
        def ok() -> bool:
            rows = self.fleet_rows()
            return all(n in rows and predicate(rows[n]) for n in names)
        self.wait(ok, timeout, what)

    def join(self, loop: LoopThread, agents: dict[str, AgentService]) -> None:
        """Each agent redeems the token shown on the Fleet page (a fresh one for each: one-time)."""
        page = self.window.fleet_page
        for name, agent in agents.items():
            token, console = page.token_edit.text(), page.enrollment_label.text()
            assert token and ":" in console
            loop.run(agent.async_join(console, token), 30, f"{name} joining")
            previous = token
            page.new_token_button.click()
            self.wait(lambda p=previous: page.token_edit.text() not in ("", p), 10, "a new join token")

    def select(self, names) -> None:
        page = self.window.fleet_page
        page.select({r.key for r in self.bridge.records if r.name in names})

    def approve(self, names) -> None:
        self.select(names)
        self.window.fleet_page.approve_button.click()
        self.wait_rows(names, lambda row: row["Approved"] == "yes", "the approvals")

    def measure_links(self, names) -> None:
        self.select(names)
        self.window.fleet_page.measure_button.click()
        self.wait_rows(names, lambda row: bool(row["RTT ms"]), "the links to be measured", timeout=120)

    # -- Models, Placement, Distribution ---------------------------------------------------------------

    def add_model(self, path: Path, weights: str = "fp32") -> None:
        page = self.window.models_page
        page.path_edit.setText(str(path))
        page.add_button.click()
        page.weights.setCurrentText(weights)
        self.wait(lambda: self.bridge.session.model is not None and self.bridge.session.model.path == path.resolve()
                  and self.bridge.session.spec.weights == weights, 5, "the model to be chosen")

    def two_agent_context(self) -> int:
        """A context whose KV cache makes one layer 0.4 of an agent's usable memory: the tiny
        model's four layers then fit on two agents (two each), never three on one; the agents'
        free memory may move by 20 % either way (other programs) before that changes."""
        def polled() -> list:
            return [r for r in self.bridge.records if r.approved and r.status is not None]
        self.wait(lambda: len(polled()) >= 2, 20, "the approved agents' status")
        free = min(r.status.inventory["ram_available"] for r in polled())
        per_token = 2 * 2 * 16 * KV_BYTES_PER_VALUE[self.bridge.session.spec.kv_cache_precision]  # 2 KV heads of 16
        return int(0.4 * 0.8 * free / per_token)

    def place(self, context: int, timeout: float = 600) -> None:
        page = self.window.placement_page
        page.context.setValue(context)
        page.place_button.click()
        self.wait(lambda: not page.busy, timeout, "the placement")

    def distribute(self, timeout: float = 600) -> None:
        page = self.window.distribution_page
        page.distribute_button.click()
        if page.confirmation is not None:  # a ring serves: the page asks before replacing it
            page.confirmation.button(QMessageBox.StandardButton.Yes).click()
        serving = self.window.serving
        self.wait(lambda: serving.phase in ("serving", "failed"), timeout, "the distribution")
        assert serving.phase == "serving", self.window.distribution_page.error_label.text()

    def chat(self, question: str, timeout: float = 120) -> str:
        self.window.show_page("Chat")
        chat = self.window.chat_page.chat
        assert chat is not None
        self.wait(lambda: chat.model_choice.count() > 0, 30, "the model list")
        chat.input.setText(question)
        chat.send()
        self.wait(lambda: not chat.streaming, timeout, "the answer")
        return chat.model.current.messages[-1].content

    def metric(self, label: str) -> str:
        page = self.window.metrics_page
        return {"tokens": page.tokens, "rate": page.rate, "streams": page.streams}[label].text()


def item_texts(widget) -> list[str]:
    return [widget.item(i).text() for i in range(widget.count())]


def checked(widget) -> list[bool]:
    return [widget.item(i).checkState() == Qt.CheckState.Checked for i in range(widget.count())]
