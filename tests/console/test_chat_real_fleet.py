"""The chat's fleet line over a real paused fleet: a real fleet host, two real in-process agents
joined with tokens, their stage-worker processes serving the tiny model's 2-stage ring under mutual
TLS, the real OpenAI API over that ring, and the chat window (Qt offscreen) on it. When desk-b's
person comes back (its agent pauses, no standby is free) the line says the fleet is paused and
names desk-b and why; when desk-b resumes the line goes away and the chat answers again."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from agent.service.service import AgentService
from agent.service.settings import AgentSettings
from console.fleet.distribution import Distributor
from console.fleet.failover import FailoverSettings
from console.fleet.ring_layout import AgentTarget, RingLayout
from console.shared.chat_model import DONE
from console.shared.chat_view import QtChatWindow
from console.shared.loop_thread import LoopThread
from engine.api.server import ApiSettings, async_run_api
from engine.control.messages import WorkerSettings
from engine.generation.tokenizer import ChatTokenizer
from tests.support.agent_helpers import FakeIdle, console
from tests.support.loopback import free_port

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("private_keyring")]

HOLD = FailoverSettings(step_timeout_s=10.0, hold_s=120.0, restart_grace_s=30.0, move_s=60.0)
WAIT_MS = 60000


def test_a_paused_agent_shows_on_the_chats_line_and_its_resume_clears_it(tmp_path, tiny_export, qtbot):
    export = tiny_export("llama", 2)
    ready: concurrent.futures.Future = concurrent.futures.Future()

    async def serve(stop: asyncio.Event) -> None:
        async with console(tmp_path / "console") as con:
            agents: list[AgentService] = []
            try:
                for name in ("desk-a", "desk-b"):
                    settings = AgentSettings(name=name, interface="127.0.0.1", control_port=0, data_port=0,
                                             kv_pool_mb=32, warm_spare="off")
                    agent = AgentService(tmp_path / name, settings, idle_source=FakeIdle(1e6), power=lambda: None)
                    agents.append(agent)
                    await agent.async_start()
                    await agent.async_join(con.enrollment, con.token())
                layout = RingLayout.of([AgentTarget(f"127.0.0.1:{a.control_port}", stage, free_port(), a.settings.name)
                                        for stage, a in enumerate(agents)])
                async with Distributor(con, export, layout, worker=WorkerSettings(threads=1, exact=True),
                                       failover=HOLD) as dist:
                    assert (await dist.async_run()).ok
                    api = await async_run_api(dist.coordinator, ChatTokenizer(export / "tokenizer"),
                                              ApiSettings(default_max_tokens=8))
                    try:
                        ready.set_result((api.url, agents[1]))
                        await stop.wait()
                    finally:
                        await api.async_stop()
            finally:
                for agent in agents:
                    await agent.async_close()

    with LoopThread("chat-real-fleet") as loop:
        stop = asyncio.Event()
        served = loop.submit(serve(stop))
        try:
            url, desk_b = ready.result(240)
            window = QtChatWindow(url, loop=loop, options={"temperature": 0, "max_tokens": 6})
            qtbot.addWidget(window)
            window.show()
            try:
                qtbot.waitUntil(lambda: window.fleet is not None and window.fleet.ok, timeout=WAIT_MS)
                loop.submit(desk_b.async_set_manual_pause(True)).result(30)

                def paused() -> bool:
                    window.check_fleet()
                    return window.fleet.level == "paused"

                qtbot.waitUntil(paused, timeout=WAIT_MS)
                text = window.fleet_label.text()
                assert window.fleet_label.isVisible() and "The fleet is paused" in text
                # the service words it "desk-b (stage 1) paused: ..." at once, the failover plan's
                # "stage 1 on desk-b is paused (...)" later: either names the PC, the stage and why
                assert "desk-b" in text and "stage 1" in text and "paused by the user" in text, text

                loop.submit(desk_b.async_set_manual_pause(False)).result(30)

                def ok_again() -> bool:
                    window.check_fleet()
                    return window.fleet.ok

                qtbot.waitUntil(ok_again, timeout=WAIT_MS)
                assert not window.fleet_label.isVisible()
                window.input.setText("Hello")
                window.send()
                qtbot.waitUntil(lambda: not window.streaming, timeout=WAIT_MS)
                assert window.model.current.messages[-1].state == DONE
            finally:
                window.close()
        finally:
            loop.call_soon(stop.set)
            served.result(120)
