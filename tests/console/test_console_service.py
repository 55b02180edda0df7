"""The console as a client of the fleet service (issue 15, Deliver 2 and 7), with real processes on
loopback: `deskfleet fleet` serves a 2-stage ring of the tiny model on two real agents; a
`deskfleet console` process attaches to it and is SIGKILLed while a chat streams through the
API: the chat completes with the unsplit model's greedy answer; then two consoles (Qt offscreen,
in this process; one over the local socket, one with an admin certificate over mutual TLS) attach
and show the same fleet, the same ring serving, and each other's news."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from console.main_window import QtConsoleWindow
from console.service.admin_client import AdminClient
from console.service.admin_shapes import plan_from_json
from console.service.console_settings import ConsoleSettings
from console.service.service_locator import async_wait_for_service, read_service_file
from console.service_bridge import ServiceBridge
from console.shared.loop_thread import LoopThread
from engine.generation.tokenizer import ChatTokenizer
from engine.shards.manifest import load_manifest
from tests.conftest import PROMPT_IDS
from tests.console.console_app_helpers import ConsoleDriver
from tests.support.console_fleet_helpers import agent
from tests.support.loopback import free_port

N = 12
pytestmark = [pytest.mark.usefixtures("private_keyring"), pytest.mark.slow,
              pytest.mark.skipif(sys.platform == "win32", reason="the local admin socket")]


def _service(state: Path, log: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "engine.cli.main", "fleet", "--state-dir", str(state), "--interface", "127.0.0.1",
            "--admin-port", str(free_port()), "--threads", "1", "--exact"]
    for flag in ("--api-port", "--enrollment-port", "--hub-port", "--data-port"):
        args += [flag, str(free_port())]
    with log.open("ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


async def _ring(admin: AdminClient, tmp_path: Path) -> tuple[list, str, str]:
    """Two agents joined and approved, ring r1 of the copied export serving: (agents, api_url, key)."""
    pcs = [agent(tmp_path, name) for name in ("desk-a", "desk-b")]
    enrollment = (await admin.async_service())["enrollment"]
    nodes = []
    for pc in pcs:
        await pc.async_start()
        await pc.async_join(enrollment, await admin.async_new_token())
        added = (await admin.async_add_address("127.0.0.1", pc.control_port))["agent"]
        await admin.async_approve(added["key"])
        nodes.append(added["node_id"])
    plan = plan_from_json({"stages": [
        {"device_id": f"{nodes[0]}/CPU", "pc_id": nodes[0], "first_layer": 0, "last_layer": 1},
        {"device_id": f"{nodes[1]}/CPU", "pc_id": nodes[1], "first_layer": 2, "last_layer": 3}]})
    made = await admin.async_create_ring(None, plan, export_id="tiny-2")
    await admin.async_wait_job(made["job"]["id"], timeout=120)
    return pcs, (await admin.async_service())["api_url"], await admin.async_console_secret()


def _console_process(state: Path, log: Path) -> subprocess.Popen:
    """`deskfleet console` (offscreen) over the service's state dir: it attaches, it serves nothing."""
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    return subprocess.Popen([sys.executable, "-m", "engine.cli.main", "console", "--state-dir", str(state),
                             "--interface", "127.0.0.1"], stdout=subprocess.PIPE, stderr=log.open("ab"),
                            stdin=subprocess.DEVNULL, env=env, text=True)


def _wait(qtbot, condition, timeout_s: float, what: str) -> None:
    try:
        qtbot.waitUntil(condition, timeout=int(timeout_s * 1000))
    except AssertionError as exc:  # pytest-qt's timeout
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}") from exc


def test_killing_the_console_mid_chat_stops_nothing_and_a_new_console_shows_the_same_fleet(
        tmp_path, tiny_export, unsplit_greedy, qtbot):
    export = tiny_export("llama", 2)
    state = tmp_path / "fleet"
    (state / "exports").mkdir(parents=True)
    shutil.copytree(export, state / "exports" / "tiny-2")
    service = _service(state, tmp_path / "service.log")
    pcs: list = []
    console = None
    loop = LoopThread("test-agents").start()  # the agents answer the service while Qt waits below
    try:
        admin, _ = loop.run(async_wait_for_service(state, timeout=90, process=service), 100, "the service")
        pcs, api_url, key = loop.run(_ring(admin, tmp_path), 240, "the ring")
        fleet_id = loop.run(admin.async_service(), 30, "the service")["fleet_id"]
        # an admin on another PC: credentials from the fleet CA, issued on the service's PC
        issued = subprocess.run([sys.executable, "-m", "engine.cli.main", "fleet", "admin-cert", "alice", "--out",
                                 str(tmp_path / "alice"), "--state-dir", str(state)], timeout=60, capture_output=True,
                                text=True)
        assert issued.returncode == 0, issued.stderr

        console = _console_process(state, tmp_path / "console.log")
        line = console.stdout.readline()  # "deskfleet console: fleet …; …; attached to the fleet service …"
        assert f"fleet {fleet_id}" in line and "attached to the fleet service" in line, line

        async def chat_through_kill() -> tuple[str, int, int]:
            async with openai.AsyncOpenAI(base_url=api_url, api_key=key, max_retries=0, timeout=60) as client:
                stream = await client.completions.create(model="llama", prompt=list(PROMPT_IDS), max_tokens=N,
                                                         temperature=0, stream=True)
                chunks = [c.choices[0].text async for c in _first(stream)]
                console.send_signal(signal.SIGKILL)  # mid-chat: the rest is not read yet
                code = await asyncio.to_thread(console.wait, 10)
                before = len(chunks)
                chunks += [c.choices[0].text async for c in stream if c.choices]
            return "".join(chunks), before, code

        text, read_before_kill, code = loop.run(chat_through_kill(), 120, "the chat")
        assert code == -signal.SIGKILL and read_before_kill >= 1
        tokens = unsplit_greedy(PROMPT_IDS, N)
        eos = set(load_manifest(export).model.eos_token_ids)
        expected = list(tokens[:next((i for i, t in enumerate(tokens) if t in eos), N)])
        assert text == ChatTokenizer(export / "tokenizer").decode(expected)
        assert service.poll() is None, "the service stopped with the console"

        # Two new consoles attach (the local one over the socket, alice's over mutual TLS) and see the
        # same fleet; one's news reaches the other.
        admin_url = read_service_file(state).admin_url
        local = ConsoleSettings(state_dir=state, interface="127.0.0.1", refresh_s=1.0)
        remote = ConsoleSettings(state_dir=tmp_path / "alice-console", interface="127.0.0.1", refresh_s=1.0,
                                 service_url=admin_url, admin_cert=tmp_path / "alice")
        windows = [QtConsoleWindow(ServiceBridge(settings)) for settings in (local, remote)]
        try:
            for w in windows:
                w.bridge.start()
            for w in windows:
                _wait(qtbot, lambda w=w: w.bridge.running, 60, "a console to attach")
                _wait(qtbot, lambda w=w: w.serving.phase == "serving", 30, "the ring to show as serving")
                _wait(qtbot, lambda w=w: sorted(r.name for r in w.bridge.records if r.approved) == ["desk-a", "desk-b"],
                      30, "the approved agents")
                assert w.bridge.fleet_id == fleet_id and not w.bridge.started_service
                assert w.serving.ring == "r1" and w.serving.api_url == api_url
                assert w.fleet_page.token_edit.text() == w.bridge.token
            first, second = windows
            # the console's own chat goes through the service's API with the console's key
            answer = ConsoleDriver(second, lambda c, t, what: _wait(qtbot, c, t, what)).chat("Hello")
            assert second.chat_page.chat.model.current.messages[-1].role == "assistant" and isinstance(answer, str)
            assert second.serving.api_key == key
            first.fleet_page.new_token_button.click()
            _wait(qtbot, lambda: second.bridge.token == first.bridge.token, 20, "the other console's token")
            # links measured by the service for a console's Fleet page
            first.fleet_page.measure_links()
            _wait(qtbot, lambda: first.fleet_page.links is not None, 90, "the links measured by the service")
            nodes = {r.node_id for r in first.bridge.records if r.approved}
            measured = first.fleet_page.links.measured
            assert {b for (a, b) in measured if a == "console"} == nodes, dict(measured)
            # the ring stopped from one console is gone from the other's pages; a pause likewise
            first.distribution_page.stop_button.click()
            _wait(qtbot, lambda: second.serving.phase == "idle" and second.serving.ring is None, 60,
                  "the stopped ring to leave the other console")
            desk_b = next(r for r in first.bridge.records if r.name == "desk-b")
            first.bridge.pause(desk_b.key)
            _wait(qtbot, lambda: any(r.name == "desk-b" and r.state == "paused" for r in second.bridge.records), 30,
                  "the other console's pause")
            # the service restarts under an attached console: its feed comes back, with the fleet
            links: list[bool] = []
            first.bridge.attached.connect(links.append)
            service.send_signal(signal.SIGKILL)
            service.wait(10)
            _wait(qtbot, lambda: links == [False], 30, "the console to notice the service is gone")
            service = _service(state, tmp_path / "service.log")
            _wait(qtbot, lambda: links == [False, True], 90, "the console to follow the restarted service")
            assert sorted(r.name for r in first.bridge.records if r.approved) == ["desk-a", "desk-b"]
        finally:
            for w in windows:
                w.shutdown()
                w.bridge.close()
                w.close()
                w.deleteLater()
        assert service.poll() is None, "a console's close stopped the service"
        loop.run(admin.async_close(), 10, "closing the client")
    finally:
        if console is not None and console.poll() is None:
            console.kill()
        if service.poll() is None:
            service.send_signal(signal.SIGTERM)
            try:
                service.wait(30)
            except subprocess.TimeoutExpired:
                service.kill()
        for pc in pcs:
            with contextlib.suppress(Exception):
                loop.run(pc.async_close(), 60, "closing an agent")
        loop.stop()


async def _first(stream):
    """The stream's first chunk with text (then the caller stops reading)."""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            yield chunk
            return
