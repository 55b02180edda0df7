"""The chat shared by the console and the tray: the Qt-free model and streaming client, then the
Qt window (offscreen, qtbot), against the real OpenAI-compatible API served by the real paged
coordinator over a tiny 2-stage export on loopback."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import time
from dataclasses import dataclass

import aiohttp
import pytest

from console.shared.chat_model import (
    DONE,
    STOPPED,
    ChatClient,
    ChatError,
    ChatModel,
    Throughput,
    async_stream_reply,
)
from console.shared.loop_thread import LoopThread
from engine.api.server import ApiSettings, async_run_api

KEY = "sk-chat-test"
SETTINGS = ApiSettings(api_key=KEY, max_prompt_tokens=200, default_max_tokens=24, max_tokens_limit=400,
                       max_concurrent=4)
QUESTION = "What is the capital of France?"
STORY = "Tell me a long story."  # the tiny model answers it with max_tokens tokens: long enough to stop
GREEDY = {"temperature": 0, "max_tokens": 16}
LONG = {"temperature": 0, "max_tokens": 400}
POOL = 16 << 20  # the tiny model's KV blocks: a few hundred, two long answers' worth many times over


@dataclass
class Api:
    url: str
    model: str


@pytest.fixture(scope="module")
def api(tiny_export):
    """The API on a thread of its own, up for the whole module (the paged coordinator's compute
    thread is started here by a first request, so no test is blamed for it)."""
    from engine.generation.request import GenerationRequest
    from engine.generation.tokenizer import ChatTokenizer
    from engine.paged.coordinator import BatchCoordinator

    export = tiny_export("llama", 2)
    tokenizer = ChatTokenizer(export / "tokenizer")
    ready: concurrent.futures.Future = concurrent.futures.Future()

    async def serve():
        stop = asyncio.Event()
        async with BatchCoordinator.local(export, slots=2, kv_pool_bytes=POOL) as coordinator:
            async for _ in coordinator.stream(GenerationRequest((1, 5, 9), 2)):
                pass
            running = await async_run_api(coordinator, tokenizer, SETTINGS)
            try:
                ready.set_result((Api(running.url, coordinator.model.name), stop))
                await stop.wait()
            finally:
                await running.async_stop()

    with LoopThread("chat-test-api") as loop:
        served = loop.submit(serve())
        value, stop = ready.result(300)
        yield value
        loop.call_soon(stop.set)
        served.result(60)


def _metrics(api: Api) -> dict[str, float]:
    async def scrape():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.get(api.url.removesuffix("/v1") + "/metrics",
                             headers={"Authorization": f"Bearer {KEY}"}) as r:
                return await r.text()
    values = {}
    for line in asyncio.run(scrape()).splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _wait_metrics(api: Api, condition, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while not condition(metrics := _metrics(api)):
        assert time.monotonic() < deadline, f"the API's metrics never met the condition: {metrics}"
        time.sleep(0.05)
    return metrics


def test_throughput_leaves_out_the_first_token():
    meter = Throughput()
    assert meter.per_second is None
    meter.add(10.0)
    assert meter.per_second is None  # one token: prefill only, no decode speed yet
    for at in (10.5, 11.0, 11.5, 12.0):
        meter.add(at)
    assert meter.per_second == pytest.approx(2.0)


def test_streamed_deltas_add_up_to_the_plain_answer(api):
    client = ChatClient(api.url, KEY)
    model = ChatModel()
    conversation = model.new_conversation()
    events = []
    model.subscribe(events.append)

    async def main():
        assert await client.async_models() == [api.model]
        messages = model.start_reply(conversation.id, QUESTION)
        plain = await client.async_complete(api.model, messages, **GREEDY)
        streamed = await async_stream_reply(client, api.model, messages,
                                            lambda text, at: model.add_delta(conversation.id, text, at), **GREEDY)
        model.end_reply(conversation.id, DONE, completion_tokens=streamed.completion_tokens)
        return plain, streamed

    plain, streamed = asyncio.run(main())
    reply = conversation.messages[-1]
    deltas = [e.text for e in events if e.kind == "delta"]
    assert plain.text and len(deltas) >= 2, "the answer did not arrive in pieces"
    assert "".join(deltas) == streamed.text == plain.text == reply.content
    assert streamed.completion_tokens == plain.completion_tokens == reply.throughput.tokens
    assert reply.state == DONE and reply.throughput.per_second > 0
    assert conversation.title == QUESTION[:40]
    assert conversation.history()[-1] == {"role": "assistant", "content": plain.text}


def test_stop_cancels_the_generation_mid_stream(api):
    client = ChatClient(api.url, KEY)
    # the earlier tests' requests are all counted first (a stream's handler may still be closing)
    before = _wait_metrics(api, lambda m: m["deskfleet_api_active_requests"] == 0)

    async def main():
        first = asyncio.Event()
        deltas = []

        def on_delta(text, at):
            deltas.append(text)
            first.set()

        task = asyncio.create_task(async_stream_reply(client, api.model, [{"role": "user", "content": STORY}],
                                                      on_delta, **LONG))
        await asyncio.wait_for(first.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return deltas

    deltas = asyncio.run(main())
    assert 1 <= len(deltas) < LONG["max_tokens"]
    after = _wait_metrics(api, lambda m: m["deskfleet_api_active_requests"] == 0
                          and m["deskfleet_requests_cancelled_total"] > before["deskfleet_requests_cancelled_total"])
    assert after["deskfleet_requests_cancelled_total"] == before["deskfleet_requests_cancelled_total"] + 1
    assert after["deskfleet_requests_finished_total"] == before["deskfleet_requests_finished_total"]


def test_errors_say_what_happened(api):
    async def main():
        with pytest.raises(ChatError, match="answered 401"):
            await ChatClient(api.url, "wrong-key").async_models()
        with pytest.raises(ChatError, match="answered 404"):
            await ChatClient(api.url, KEY).async_complete("no-such-model", [{"role": "user", "content": "hi"}])
        with pytest.raises(ChatError, match="cannot reach"):
            await ChatClient("http://127.0.0.1:9/v1").async_models()

    asyncio.run(main())


# -- the window -------------------------------------------------------------------------------------

def _open_window(qtbot, api: Api, options: dict):
    from console.shared.chat_view import QtChatWindow

    window = QtChatWindow(api.url, api_key=KEY, options=options)
    qtbot.addWidget(window)
    window.show()
    qtbot.waitUntil(lambda: window.model_choice.count() == 1, timeout=15000)
    assert window.model_choice.currentText() == api.model
    return window


def test_window_streams_the_answer_and_shows_tok_per_s(qtbot, api):
    plain = asyncio.run(ChatClient(api.url, KEY).async_complete(
        api.model, [{"role": "user", "content": QUESTION}], **GREEDY))
    window = _open_window(qtbot, api, GREEDY)
    try:
        seen = []  # the transcript's text each time a delta reached the view
        window.model.subscribe(lambda e: seen.append(window.transcript.toPlainText()) if e.kind == "delta" else None)
        assert window.speed_label.text() == "— tok/s" and not window.stop_button.isEnabled()
        window.input.setText(QUESTION)
        qtbot.mouseClick(window.send_button, qtbot_button())
        assert window.streaming and window.stop_button.isEnabled() and not window.send_button.isEnabled()
        qtbot.waitUntil(lambda: not window.streaming, timeout=30000)

        reply = window.model.current.messages[-1]
        assert reply.state == DONE and reply.content == plain.text
        assert len(seen) >= 2, "the answer did not reach the view in pieces"
        assert " ".join(plain.text.split()) in " ".join(window.transcript.toPlainText().split())
        assert re.fullmatch(r"\d+\.\d tok/s", window.speed_label.text()), window.speed_label.text()
        assert window.conversation_list.item(0).text() == QUESTION[:40]
        assert window.send_button.isEnabled() and not window.stop_button.isEnabled()
        assert not window.error_label.isVisible()
    finally:
        window.close()


def test_window_stop_button_ends_the_reply(qtbot, api):
    window = _open_window(qtbot, api, LONG)
    try:
        window.input.setText(STORY)
        window.send()
        qtbot.waitUntil(lambda: window.model.current.messages[-1].content != "", timeout=30000)
        qtbot.mouseClick(window.stop_button, qtbot_button())
        qtbot.waitUntil(lambda: not window.streaming, timeout=10000)
        reply = window.model.current.messages[-1]
        assert reply.state == STOPPED
        assert "(stopped)" in window.transcript.toPlainText()
        _wait_metrics(api, lambda m: m["deskfleet_api_active_requests"] == 0)
        # the next question is answered in the same conversation, with the stopped reply as context
        window.options = GREEDY
        window.input.setText("And of Italy?")
        window.send()
        qtbot.waitUntil(lambda: not window.streaming, timeout=30000)
        assert window.model.current.messages[-1].state == DONE
        assert [m.role for m in window.model.current.messages] == ["user", "assistant", "user", "assistant"]
    finally:
        window.close()


def test_window_without_a_fleet_says_so(qtbot):
    from console.shared.chat_view import QtChatWindow

    window = QtChatWindow("http://127.0.0.1:9/v1")
    qtbot.addWidget(window)
    try:
        qtbot.waitUntil(lambda: window.fleet is not None, timeout=15000)
        assert "cannot reach the fleet's API at http://127.0.0.1:9/v1" in window.fleet_label.text()
        assert window.fleet.level == "unreachable" and not window.fleet_label.isHidden()
        window.input.setText("hello?")
        window.send()
        assert not window.streaming and "listed no model" in window.error_label.text()
    finally:
        window.close()


def qtbot_button():
    from PySide6.QtCore import Qt

    return Qt.MouseButton.LeftButton
