"""Distribution end to end on loopback: a real fleet host, two real in-process agents joined with
join tokens, real stage-worker processes, mutual TLS everywhere. A 3-stage export with stage 0 in
the console (decided by the plan; paged, stage 0 in the console's process) and a 2-stage export
entirely on agents both generate exactly what the unsplit model generates — paged, three chats at
once and a follow-up turn reusing its conversation's blocks, with the ring's pool sized by the
smaller agent's KV budget; and stateful (the identity reference). A failed fetch is reported by
agent name and a re-run resumes without sending verified files again, and so is an agent too old
to serve paged, before anything is fetched; the OpenAI API on the
resulting coordinator answers the real `openai` client; closing stops every worker."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from dataclasses import replace
from pathlib import Path

import openai
import pytest

from agent.service.service import AgentService
from agent.service.settings import AgentSettings
from console.fleet.distribution import Distributor
from console.fleet.errors import AgentsFailedError, DistributionError, LayoutError
from console.fleet.models import ModelLibrary
from console.fleet.ring_layout import AgentEndpoint, AgentTarget, RingLayout
from console.fleet.ring_runtime import stage_pool_blocks
from engine.api.server import ApiSettings, async_run_api
from engine.control.fleet_services import MEMBER_KEY_RPM
from engine.control.messages import WorkerSettings
from engine.generation.request import GenerationRequest
from engine.generation.tokenizer import ChatTokenizer
from engine.paged.coordinator import BatchCoordinator
from engine.placement.types import Plan, PlannedStage
from engine.shards.manifest import load_manifest
from engine.static.packed_generator import PackedGenerator
from engine.static.packed_stage import StaticChain, static_generate
from tests.conftest import PROMPT_IDS
from tests.support.agent_helpers import FakeIdle, console
from tests.support.asyncutil import collect, run
from tests.support.loopback import free_port
from tests.support.npu_helpers import npu_export

N = 12
WORKER = WorkerSettings(threads=1, exact=True)


pytestmark = pytest.mark.usefixtures("private_keyring")


def _plan(*stages: tuple[str, int, int]) -> Plan:
    planned = tuple(PlannedStage(f"{pc}/CPU", pc, a, b, 1.0, 1 << 20) for pc, a, b in stages)
    return Plan(stages=planned, hop_ms=(0.0,) * (len(planned) + 1), per_token_ms=1.0, tok_s=1000.0,
                bottleneck_ms=1.0, n_streams=1, cycle_ms=1.0, aggregate_tok_s=1000.0, objective="latency",
                optimal=True)


@contextlib.asynccontextmanager
async def _agents(tmp_path: Path, con, names: tuple[str, ...], pool_mb: tuple[int, ...] = ()):
    """Started, joined agents on loopback with OS-chosen control ports (``pool_mb``: their KV budgets)."""
    agents = []
    try:
        for i, name in enumerate(names):
            settings = AgentSettings(name=name, interface="127.0.0.1", control_port=0, data_port=0,
                                     kv_pool_mb=pool_mb[i] if i < len(pool_mb) else 64)
            agent = AgentService(tmp_path / name, settings, idle_source=FakeIdle(1e6), power=lambda: None)
            agents.append(agent)
            await agent.async_start()
            await agent.async_join(con.enrollment, con.token())
        yield agents
    finally:
        for agent in agents:
            await agent.async_close()


def _stage_bytes(export: Path, stage: int) -> int:
    return sum(f.size for f in load_manifest(export).stages[stage].files)


def _fetch_complete(progress, agent: str) -> bool:
    return any(p.agent == agent and p.phase == "verified" and p.fraction == 1.0 and p.done_bytes > 0
               for p in progress)


@pytest.mark.slow
def test_three_stages_with_stage0_in_the_console_resume_after_a_failed_fetch_and_serve_the_api(
        tmp_path, tiny_export, unsplit_greedy):
    export = tiny_export("llama", 3)
    tokenizer = ChatTokenizer(export / "tokenizer")

    async def main():
        async with console(tmp_path / "console") as con, _agents(tmp_path, con, ("desk-a", "desk-b")) as agents:
            endpoints = {f"pc-{i}": AgentEndpoint(f"127.0.0.1:{agent.control_port}", free_port(), agent.settings.name)
                         for i, agent in enumerate(agents)}
            plan = _plan(("console-pc", 0, 1), ("pc-0", 2, 2), ("pc-1", 3, 3))
            layout = RingLayout.from_plan(plan, endpoints, console_pc_id="console-pc")
            assert layout.local_stage0
            assert [(t.label, t.stage) for t in layout.targets] == [("desk-a", 1), ("desk-b", 2)]

            # desk-b cannot write its stage directory (a file is in the way): its fetch fails
            blocker = tmp_path / "desk-b" / "shards" / "tiny-3" / "stage_2"
            blocker.parent.mkdir(parents=True)
            blocker.write_text("in the way")
            progress = []
            async with Distributor(con, export, layout, export_id="tiny-3", worker=WORKER,
                                   api_url="http://127.0.0.1:9/v1", on_progress=progress.append) as dist:
                with pytest.raises(AgentsFailedError) as failed:
                    await dist.async_run()
                assert [(f.agent, f.stage) for f in failed.value.failures] == [("desk-b", 2)]
                assert "desk-b" in str(failed.value) and "stage_2" in str(failed.value)
                assert con.hub.bytes_served == _stage_bytes(export, 1)  # only desk-a's stage travelled
                assert _fetch_complete(progress, "desk-a") and not _fetch_complete(progress, "desk-b")
                assert [p.phase for p in dist.progress()] == ["verified", "failed"]
                assert all(a.status().worker.state == "stopped" for a in agents)  # nothing started

                blocker.unlink()
                served = con.hub.bytes_served
                health = await dist.async_run()
                assert health.ok and health.local_stage0 and health.test_token is not None
                assert con.hub.bytes_served - served == _stage_bytes(export, 2)  # desk-a got nothing again
                assert _fetch_complete(progress, "desk-b")
                assert [p.phase for p in dist.progress()] == ["running", "running"]
                assert [a.status().stage for a in agents] == [1, 2]
                # for the tray's chat: each member its own limited key, never the console's (issue 29, M9)
                member_keys = [a.assignment.api_key for a in agents]
                assert all(member_keys) and con.api_key not in member_keys and len(set(member_keys)) == 2
                for agent, key in zip(agents, member_keys, strict=True):
                    held = con.keys.identify(key)
                    assert held.node_id == agent.status().node_id and held.rpm == MEMBER_KEY_RPM

                tokens = await collect(dist.coordinator, GenerationRequest(PROMPT_IDS, N, ignore_eos=True))
                assert isinstance(dist.coordinator, BatchCoordinator)  # paged, stage 0 in this process
                assert dist.coordinator.metrics()['stage_compute_ms_per_step{stage="0"}'] > 0

                api = await async_run_api(dist.coordinator, ChatTokenizer(dist.tokenizer_dir), ApiSettings(),
                                          keys=con.keys)
                try:  # what a member does with its key: the tray's chat, on the fleet's real API
                    async with openai.AsyncOpenAI(base_url=api.url, api_key=member_keys[0], max_retries=0,
                                                  timeout=60) as client:
                        models = [m.id async for m in client.models.list()]
                        completion = await client.completions.create(model=models[0], prompt=list(PROMPT_IDS),
                                                                     max_tokens=N, temperature=0)
                finally:
                    await api.async_stop()
            assert all(a.status().worker.state == "stopped" for a in agents)  # close stopped the workers
            return tokens, models, completion

    tokens, models, completion = run(main())
    assert tuple(tokens) == unsplit_greedy(PROMPT_IDS, N)
    assert models == [load_manifest(export).model.name]
    eos = set(load_manifest(export).model.eos_token_ids)
    unsplit = unsplit_greedy(PROMPT_IDS, N)
    expected = list(unsplit[:next((i for i, t in enumerate(unsplit) if t in eos), N)])
    assert expected and completion.choices[0].text == tokenizer.decode(expected)
    assert completion.choices[0].finish_reason == ("length" if len(expected) == N else "stop")


CHATS = (PROMPT_IDS, tuple(range(40, 90)), PROMPT_IDS[:7])  # the second fills a whole KV block


def test_two_stages_on_two_agents_serve_concurrent_chats_as_the_unsplit_model(tmp_path, tiny_export, unsplit_greedy):
    export = tiny_export("llama", 2)
    manifest = load_manifest(export)
    budgets = (48, 24)  # MiB: desk-b's budget sizes the ring's pool

    async def main():
        async with console(tmp_path / "console") as con, \
                _agents(tmp_path, con, ("desk-a", "desk-b"), budgets) as agents:
            layout = RingLayout.of([AgentTarget(f"127.0.0.1:{a.control_port}", stage, free_port(), a.settings.name)
                                    for stage, a in enumerate(agents)])
            assert not layout.local_stage0
            progress = []
            async with Distributor(con, export, layout, worker=WORKER, on_progress=progress.append) as dist:
                health = await dist.async_run()
                assert health.ok and not health.local_stage0
                assert _fetch_complete(progress, "desk-a") and _fetch_complete(progress, "desk-b")
                served = con.hub.bytes_served
                assert served == _stage_bytes(export, 0) + _stage_bytes(export, 1)
                assert [a.assignment.runtime for a in agents] == ["paged", "paged"]
                assert [a.status().kv_pool_mb for a in agents] == list(budgets)
                # three chats at once, then a follow-up turn of the second one
                answers = await asyncio.gather(*(collect(dist.coordinator, GenerationRequest(p, N, ignore_eos=True))
                                                 for p in CHATS))
                follow_up = (*CHATS[1], *answers[1], 5, 6)
                answers.append(await collect(dist.coordinator, GenerationRequest(follow_up, N, ignore_eos=True)))
                metrics = dist.coordinator.metrics()
                coordinator = dist.coordinator
                pids = [a.worker_pid for a in agents]
                again = await dist.async_run()  # already up: only checked
                assert again.ok and con.hub.bytes_served == served and [a.worker_pid for a in agents] == pids
                first_fetching = next(p for p in progress
                                      if p.agent == "desk-a" and p.phase in ("fetching", "verified"))
                assert first_fetching.total_bytes == _stage_bytes(export, 0)
                pool = dist.pool_blocks
            assert all(a.status().worker.state == "stopped" for a in agents)
            return answers, follow_up, metrics, coordinator, pool

    answers, follow_up, metrics, coordinator, pool = run(main())
    for prompt, tokens in zip((*CHATS, follow_up), answers, strict=True):
        assert tuple(tokens) == unsplit_greedy(prompt, N)
    assert isinstance(coordinator, BatchCoordinator)
    assert pool == stage_pool_blocks(manifest, WORKER, 1, "desk-b", budgets[1]) < \
        stage_pool_blocks(manifest, WORKER, 0, "desk-a", budgets[0])
    assert metrics["kv_blocks_total"] == pool - 4  # the scratch blocks apart
    assert metrics["prefix_hits_total"] >= 1  # the follow-up reused its conversation's full blocks
    assert metrics["requests_failed_total"] == 0


def test_a_ring_asked_to_serve_stateful_is_refused_naming_the_change(tmp_path, tiny_export):
    """The retired runtime, asked for by an old setting or caller, is refused before anything runs."""
    layout = RingLayout.of([AgentTarget("127.0.0.1:1", 0, 2, "desk-a")])
    with pytest.raises(DistributionError, match="the stateful runtime was retired; paged serves CPU/GPU, static "
                                                "the NPU"):
        Distributor(object(), tiny_export("llama", 1), layout, runtime="stateful")  # type: ignore[arg-type]


class _OldAgent(AgentService):
    """An agent from before paged rings: its status carries no KV pool budget."""

    def status(self):
        return replace(super().status(), kv_pool_mb=None)


@pytest.mark.slow
def test_an_agent_too_old_for_a_paged_ring_is_named_before_anything_is_fetched(tmp_path, tiny_export):
    export = tiny_export("llama", 2)

    async def main():
        async with console(tmp_path / "console") as con, _agents(tmp_path, con, ("desk-a",)) as agents:
            old = _OldAgent(tmp_path / "desk-old", AgentSettings(name="desk-old", interface="127.0.0.1", control_port=0,
                                                                  data_port=0), idle_source=FakeIdle(1e6),
                            power=lambda: None)
            await old.async_start()
            try:
                await old.async_join(con.enrollment, con.token())
                layout = RingLayout.of([AgentTarget(f"127.0.0.1:{a.control_port}", stage, free_port(), a.settings.name)
                                        for stage, a in enumerate((agents[0], old))])
                async with Distributor(con, export, layout, worker=WORKER) as dist:
                    with pytest.raises(AgentsFailedError) as failed:
                        await dist.async_run()
                return failed.value, con.hub.bytes_served
            finally:
                await old.async_close()

    failed, served = run(main())
    assert [(f.agent, f.stage) for f in failed.failures] == [("desk-old", 1)]
    assert "too old to serve a paged ring" in str(failed) and "update Deskfleet on that PC" in str(failed)
    assert served == 0


def test_layouts_that_cannot_make_a_ring_are_refused_with_the_reason():
    endpoints = {"pc-a": AgentEndpoint("10.0.0.5:7210"), "pc-b": AgentEndpoint("10.0.0.6:7210")}
    with pytest.raises(LayoutError, match="pc-x"):
        RingLayout.from_plan(_plan(("pc-a", 0, 1), ("pc-x", 2, 3)), endpoints)
    with pytest.raises(LayoutError, match="only stage 0"):
        RingLayout.from_plan(_plan(("pc-a", 0, 1), ("console", 2, 3)), endpoints, console_pc_id="console")
    on_agents = RingLayout.from_plan(_plan(("pc-a", 0, 1), ("pc-b", 2, 3)), endpoints, console_pc_id="console")
    assert not on_agents.local_stage0
    assert [t.data_address for t in on_agents.targets] == ["10.0.0.5:7211", "10.0.0.6:7211"]
    on_agents.check(2)
    with pytest.raises(LayoutError, match="3 stages"):
        on_agents.check(3)
    with pytest.raises(LayoutError, match="two stages"):
        RingLayout.of([("10.0.0.5:7210", 0), ("10.0.0.5:7210", 1)]).check(2)
    same_data = RingLayout.of([AgentTarget("10.0.0.5:7210", 0), AgentTarget("10.0.0.5:7310", 1)])
    with pytest.raises(LayoutError, match="data port"):
        same_data.check(2)
    RingLayout.of([same_data.targets[0], replace(same_data.targets[1], data_port=7212)]).check(2)


@pytest.mark.slow
def test_an_npu_export_from_the_library_is_served_by_the_static_runtime(tmp_path, tmp_path_factory, tiny_checkpoint):
    """An NPU-target export in the fleet service's model library goes to its agents as static
    workers and is answered by the packed generator (the static runtime), token for token as its
    static stages in one process: nothing hands it to a runtime that cannot run it."""
    library = ModelLibrary(tmp_path / "library")
    library.exports_dir.mkdir(parents=True)
    shutil.copytree(npu_export(tmp_path_factory, tiny_checkpoint("llama"), stages=2, context=64),
                    library.exports_dir / "tiny-npu")
    info = library.export("tiny-npu")
    assert info.key.target == "npu"
    expected = static_generate(StaticChain.load(info.path, exact=True), PROMPT_IDS, N, ignore_eos=True)

    async def main():
        async with console(tmp_path / "console") as con, _agents(tmp_path, con, ("desk-a", "desk-b")) as agents:
            layout = RingLayout.of([AgentTarget(f"127.0.0.1:{a.control_port}", stage, free_port(), a.settings.name)
                                    for stage, a in enumerate(agents)])
            async with Distributor(con, info.path, layout, export_id=info.export_id, worker=WORKER) as dist:
                health = await dist.async_run()
                assert health.ok and not health.local_stage0
                runtimes = [a.assignment.runtime for a in agents]
                tokens = await collect(dist.coordinator, GenerationRequest(PROMPT_IDS, N, ignore_eos=True))
                return runtimes, tokens, dist.coordinator

    runtimes, tokens, generator = run(main())
    assert runtimes == ["static", "static"]
    assert isinstance(generator, PackedGenerator)
    assert list(tokens) == list(expected)
