"""The router over real paged coordinators (in-process stages of the tiny llama, exact settings),
alone and behind the real API with the real `openai` client: two rings of one model serve 8
users at once, both are used, and every answer is its solo greedy run; a conversation's next
turn goes back to the ring that holds its prefix; adding and removing rings interrupts nothing;
/v1/models lists every served model, an unknown one is 404 model_not_found; /health reports
every ring, and a stopped ring is routed around."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib

import aiohttp
import openai
import pytest

from engine.api.server import ApiSettings, async_run_api
from engine.generation.generator import UnavailableError
from engine.generation.request import GenerationRequest
from engine.generation.ring_report import RingStatus
from engine.generation.router import Router, RouterError, UnknownModelError
from engine.paged.coordinator import BatchCoordinator
from tests.api.test_api import parse_prometheus, serve_in_thread
from tests.conftest import PROMPT_IDS
from tests.support.asyncutil import collect, run, until

POOL = 16 << 20
KEY = "sk-router-test"
SETTINGS = ApiSettings(api_key=KEY, max_prompt_tokens=200, default_max_tokens=16, max_tokens_limit=64)
USERS = 8
# eight distinct prompts (the users), each longer than one 32-token block
PROMPTS = [tuple((t + 13 * u) % 500 + 3 for t in PROMPT_IDS * 3) for u in range(USERS)]
N = 12


def paged(export) -> BatchCoordinator:
    return BatchCoordinator.local(export, exact=True, kv_pool_bytes=POOL, slots=8)


def greedy(unsplit_greedy, prompt, n: int, eos: tuple[int, ...]) -> list[int]:
    """The solo greedy run, cut after the first end token as the API's request is."""
    ids = list(unsplit_greedy(prompt, n))
    stop = next((i for i, t in enumerate(ids) if t in eos), None)
    return ids if stop is None else ids[: stop + 1]


# -- the router alone -----------------------------------------------------------------------------

@pytest.mark.slow  # two rings of streams run while rings come and go: ~15 s here
def test_adding_and_removing_rings_interrupts_no_stream(tiny_export, unsplit_greedy):
    """Streams on ring a; ring b added mid-stream takes the next ones (least loaded); ring a removed
    while its streams run: they finish whole, removal waits for them, and new requests go to b."""
    export = tiny_export("llama", 1)
    n = 24
    expected = [list(unsplit_greedy(p, n)) for p in PROMPTS[:6]]

    async def main():
        async with paged(export) as a, paged(export) as b:
            router = Router()
            router.add_ring("a", a)

            def ask(prompt):
                return asyncio.create_task(collect(router, GenerationRequest(prompt, n, ignore_eos=True)))

            # a's two streams are held open after their first token (the tiny model would otherwise
            # finish them before b is added on an idle box): a is busy, then draining, for certain
            async with contextlib.AsyncExitStack() as held:
                streams = [await held.enter_async_context(contextlib.aclosing(router.stream(
                    GenerationRequest(p, n, ignore_eos=True)))) for p in PROMPTS[:2]]
                first = [[(await anext(s)).token_id] for s in streams]
                router.add_ring("b", b)
                second = [ask(p) for p in PROMPTS[2:4]]
                await until(lambda: b.metrics()["tokens_generated_total"] >= 2, "ring b generating")
                removal = asyncio.create_task(router.remove_ring("a", timeout=60))
                await asyncio.sleep(0)
                assert not removal.done() and "a" not in router.rings()
                third = [ask(p) for p in PROMPTS[4:6]]  # a is draining: these go to b
                await asyncio.sleep(0.2)
                assert not removal.done()  # removal waits for a's streams
                for tokens, stream in zip(first, streams, strict=True):
                    tokens += [e.token_id async for e in stream]
            assert await removal is a
            answers = [*first, *[await t for t in (*second, *third)]]
            return answers, a.metrics(), b.metrics()

    answers, on_a, on_b = run(main(), timeout=300)
    assert answers == expected
    assert on_a["requests_finished_total"] == 2 and on_b["requests_finished_total"] == 4


@pytest.mark.slow  # one ring of one slot decodes a long answer first: ~7 s here
def test_a_full_ring_hands_the_request_to_the_next(tiny_export, unsplit_greedy, caplog):
    """Ring a (one slot, no queue) holds a conversation's prefix but is busy with it: the next turn
    is refused there before any token and served by ring b, identical; only admitted requests count."""
    export = tiny_export("llama", 1)
    prompt = PROMPTS[0]

    async def main():
        async with BatchCoordinator.local(export, exact=True, kv_pool_bytes=POOL, slots=1, max_waiting=0) as a, \
                paged(export) as b:
            router = Router()
            router.add_ring("a", a)
            router.add_ring("b", b)
            # the second turn is asked for as soon as the first's first token is out, so a's one slot
            # is still taken (polling for it let the tiny model finish all 24 tokens first on an idle box)
            async with contextlib.aclosing(router.stream(GenerationRequest(prompt, 24, ignore_eos=True))) as events:
                first = [(await anext(events)).token_id]
                second = await collect(router, GenerationRequest(prompt, N, ignore_eos=True))
                first += [e.token_id async for e in events]
            return first, second, router.metrics()

    with caplog.at_level("INFO", logger="deskfleet.router"):
        first, second, metrics = run(main())
    assert "ring a refused a request" in caplog.text  # it held the prefix, so it was asked first
    assert first == list(unsplit_greedy(prompt, 24)) and second == list(unsplit_greedy(prompt, N))
    model = 'model="' + next(k for k in metrics if k.startswith("router_requests_total")).split('model="')[1]
    assert metrics[f'router_requests_total{{ring="a",{model}'] == 1
    assert metrics[f'router_requests_total{{ring="b",{model}'] == 1


def test_rings_and_models_are_checked(tiny_export):
    export = tiny_export("llama", 1)

    async def main():
        async with paged(export) as a:
            router = Router()
            with pytest.raises(UnavailableError, match="no ring is serving"):
                router.model  # noqa: B018 - nothing served yet
            router.add_ring("a", a)
            with pytest.raises(RouterError, match="already served"):
                router.add_ring("a", a)
            twin = dataclass_card_twin(a)
            with pytest.raises(RouterError, match="different model card"):
                router.add_ring("b", twin)
            with pytest.raises(UnknownModelError, match=f"served models: '{a.model.name}'"):
                await collect(_ModelOf(router, "gpt-4"), GenerationRequest((1, 2), 2))
            with pytest.raises(RouterError, match="no ring 'zz'"):
                await router.remove_ring("zz")

    run(main())


class _ModelOf:
    """``stream`` on a named model of a router (what the API does with a request's ``model``)."""

    def __init__(self, router: Router, model: str):
        self.router, self.name = router, model

    def stream(self, request):
        return self.router.stream_for(self.name, request)


def dataclass_card_twin(coordinator: BatchCoordinator):
    """A generator claiming the same model name with another context length: refused by the router."""
    import dataclasses

    class Twin:
        model = dataclasses.replace(coordinator.model, context_length=coordinator.model.context_length // 2)

        def stream(self, request):
            return coordinator.stream(request)

        def metrics(self):
            return {}

    return Twin()


# -- behind the API, with the openai client -------------------------------------------------------

@pytest.fixture(scope="module")
def served(tiny_export):
    from engine.generation.tokenizer import ChatTokenizer

    export = tiny_export("llama", 1)
    tokenizer = ChatTokenizer(export / "tokenizer")

    @contextlib.asynccontextmanager
    async def setup():
        async with paged(export) as a, paged(export) as b, paged(export) as twin:
            for ring in (a, b, twin):  # each ring's first step starts its compute thread: before any test
                await collect(ring, GenerationRequest((1, 5, 9), 2))
            router = Router()
            router.add_ring("a", a)
            router.add_ring("b", b)
            router.add_ring("twin", twin, model_name="tiny-twin")
            name = a.model.name
            api = await async_run_api(router, {name: tokenizer, "tiny-twin": tokenizer}, SETTINGS)
            try:
                yield api.url, name, {"a": a, "b": b, "twin": twin}, asyncio.get_running_loop()
            finally:
                await api.async_stop()

    with serve_in_thread(setup, timeout=300) as value:
        yield value


@pytest.fixture
def client(served):
    with openai.OpenAI(base_url=served[0], api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def scrape(url: str, path: str) -> tuple[int, dict | str]:
    async def get():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.get(url.removesuffix("/v1") + path, headers={"Authorization": f"Bearer {KEY}"}) as r:
                return r.status, await (r.json() if path == "/health" else r.text())
    return asyncio.run(get())


def test_two_rings_serve_eight_users_each_answer_its_solo_greedy_run(served, client, tiny_export, unsplit_greedy):
    from engine.generation.tokenizer import ChatTokenizer

    url, model, rings, _ = served
    tokenizer = ChatTokenizer(tiny_export("llama", 1) / "tokenizer")
    eos = rings["a"].model.eos_token_ids
    before = parse_prometheus(scrape(url, "/metrics")[1])

    def ask(prompt):
        answer = client.completions.create(model=model, prompt=list(prompt), max_tokens=N, temperature=0)
        return answer.choices[0].text, answer.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(USERS) as pool:
        answers = list(pool.map(ask, PROMPTS))
    after = parse_prometheus(scrape(url, "/metrics")[1])
    expected = [greedy(unsplit_greedy, p, N, eos) for p in PROMPTS]
    assert [n for _, n in answers] == [len(e) for e in expected]
    assert [text for text, _ in answers] == [tokenizer.decode(e) for e in expected]
    served_by = {ring: after[f'deskfleet_router_requests_total{{model="{model}",ring="{ring}"}}']
                 - before[f'deskfleet_router_requests_total{{model="{model}",ring="{ring}"}}'] for ring in "ab"}
    assert sum(served_by.values()) == USERS
    assert min(served_by.values()) >= 2, f"one ring took nearly everything: {served_by}"


def test_a_conversation_returns_to_the_ring_holding_its_prefix(served, client, unsplit_greedy):
    """The second turn (first prompt + its answer + more) goes to the ring that served the first,
    though the balancer would send it to the other (which has served fewer)."""
    url, model, rings, _ = served
    eos = rings["a"].model.eos_token_ids

    def counts():
        m = parse_prometheus(scrape(url, "/metrics")[1])
        return {r: m[f'deskfleet_router_requests_total{{model="{model}",ring="{r}"}}'] for r in "ab"}

    for _ in range(3):  # level the rings: an idle router gives a request to the ring that served fewer
        if len(set(counts().values())) == 1:
            break
        client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=1, temperature=0)
    before = counts()
    assert len(set(before.values())) == 1
    turn1 = [(t * 7) % 500 + 3 for t in range(64)]  # two full blocks
    client.completions.create(model=model, prompt=turn1, max_tokens=N, temperature=0)
    after1 = counts()
    (holder,) = (r for r in "ab" if after1[r] > before[r])
    turn2 = [*turn1, *greedy(unsplit_greedy, tuple(turn1), N, eos), *range(100, 120)]
    client.completions.create(model=model, prompt=turn2, max_tokens=4, temperature=0)
    after2 = counts()
    assert after2[holder] == after1[holder] + 1, f"the second turn left ring {holder}: {after1} -> {after2}"
    # a fresh conversation is balanced as usual: to the ring that served fewer
    client.completions.create(model=model, prompt=[(t * 11) % 500 + 3 for t in range(64)], max_tokens=2)
    assert counts()[holder] == after2[holder]


def test_models_lists_every_served_model_and_an_unknown_one_is_404(served, client):
    _, model, _, _ = served
    assert [m.id for m in client.models.list()] == [model, "tiny-twin"]
    assert client.models.retrieve("tiny-twin").id == "tiny-twin"
    twin = client.completions.create(model="tiny-twin", prompt=list(PROMPTS[1]), max_tokens=N, temperature=0)
    same = client.completions.create(model=model, prompt=list(PROMPTS[1]), max_tokens=N, temperature=0)
    assert twin.model == "tiny-twin" and same.model == model and twin.choices[0].text == same.choices[0].text
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and "tiny-twin" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_health_reports_every_ring_and_a_stopped_ring_is_routed_around(served, client):
    url, model, rings, loop = served
    status, health = scrape(url, "/health")
    assert status == 200 and health["status"] == "ok"
    assert [(r["ring"], r["model"], r["status"]) for r in health["rings"]] == [
        ("a", model, "ok"), ("b", model, "ok"), ("twin", "tiny-twin", "ok")]
    asyncio.run_coroutine_threadsafe(rings["twin"].async_stop(), loop).result(60)
    status, health = scrape(url, "/health")
    twin = next(r for r in health["rings"] if r["ring"] == "twin")
    assert status == 200 and health["status"] == RingStatus.RECOVERING.value  # a and b still serve
    assert twin["status"] == "down" and twin["detail"]
    with pytest.raises(openai.APIStatusError) as info:  # its only ring is down: a clear 503
        client.completions.create(model="tiny-twin", prompt="hi", max_tokens=2)
    assert info.value.status_code == 503
    answer = client.completions.create(model=model, prompt=list(PROMPTS[2]), max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens >= 1
