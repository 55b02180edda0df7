"""Failover mid-generation: a stage worker is killed while streams decode; the coordinator notices
(step timeout), gets the stage back, replays every stream's tokens on the new ring and carries on.
Under greedy decoding every answer is identical to an undisturbed run, with no token lost or
repeated; without a replacement the streams fail with a clear error after the hold time."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import psutil
import pytest

from engine.coordinator.scheduler import StreamState, apply_reply, plan_step, reset_for_replay
from engine.generation.generator import UnavailableError
from engine.generation.request import GenerationRequest
from engine.shards.step_path import StepResult
from engine.tools.local_fleet import local_fleet
from tests.conftest import PROMPT_IDS
from tests.support.asyncutil import run

N = 40


def _kill_worker(stage: int) -> None:
    """SIGKILL this test's worker process for ``stage`` (no drain, no goodbye)."""
    for child in psutil.Process(os.getpid()).children(recursive=True):
        argv = child.cmdline()
        if "worker" in argv and "--stage" in argv and argv[argv.index("--stage") + 1] == str(stage):
            child.send_signal(signal.SIGKILL)
            return
    raise AssertionError(f"no worker process for stage {stage}")


async def _collect_with_kill(coordinator, prompts, *, kill_stage: int, after_tokens: int):
    got = {p: [] for p in prompts}
    killed = asyncio.Event()

    async def consume(prompt):
        async for event in coordinator.stream(GenerationRequest(prompt, N, ignore_eos=True)):
            got[prompt].append(event.token_id)
            if len(got[prompt]) == after_tokens and not killed.is_set():
                killed.set()
                _kill_worker(kill_stage)

    await asyncio.gather(*(consume(p) for p in prompts))
    return got


@pytest.mark.slow
@pytest.mark.parametrize("kill_stage, host_stage0", [(1, False), (0, False), (1, True)])
def test_a_killed_stage_is_replaced_and_answers_are_identical(tiny_export, unsplit_greedy, kill_stage,
                                                              host_stage0):
    export = tiny_export("llama", 3 if host_stage0 else 2)
    prompts = (PROMPT_IDS, PROMPT_IDS[:7])

    async def main():
        async with local_fleet(export, exact=True, failover=True, host_stage0=host_stage0, step_timeout_s=2.0,
                               prefill_chunk=5) as c:
            got = await _collect_with_kill(c, prompts, kill_stage=kill_stage, after_tokens=N // 2)
            return got, c.metrics()

    got, metrics = run(main())
    for prompt in prompts:
        assert tuple(got[prompt]) == unsplit_greedy(prompt, N)
    assert metrics["failovers_total"] >= 1
    assert metrics["requests_failed_total"] == 0


@pytest.mark.slow
def test_without_a_replacement_streams_fail_clearly_after_the_hold_time(tiny_export, unsplit_greedy):
    export = tiny_export("llama", 2)

    async def main():
        async def never(path, reason):
            await asyncio.sleep(3600)

        async with local_fleet(export, exact=True, step_timeout_s=1.0, recover=never, hold_timeout_s=2.0) as c:
            tokens = []
            with pytest.raises(UnavailableError, match="no replacement"):
                async for event in c.stream(GenerationRequest(PROMPT_IDS, N, ignore_eos=True)):
                    tokens.append(event.token_id)
                    if len(tokens) == 5:
                        _kill_worker(1)
            return tokens, c.metrics()

    tokens, metrics = run(main())
    # a step already past the killed stage may still deliver its token: what arrived is a true
    # prefix of the answer (nothing lost or repeated), then the request fails once, clearly
    assert 5 <= len(tokens) < N and tuple(tokens) == unsplit_greedy(PROMPT_IDS, N)[: len(tokens)]
    assert metrics["requests_failed_total"] == 1


def test_replay_feeds_everything_once_and_drops_the_known_prediction():
    state = StreamState(1, GenerationRequest((5, 6, 7), 10, ignore_eos=True), 64, frozenset())
    step = plan_step(state, 8)  # the prompt
    apply_reply(state, StepResult(1, step.seq, ids=np.array([11]), probs=np.array([1.0], dtype=np.float32)))
    step = plan_step(state, 8)  # decode: feeds 11
    apply_reply(state, StepResult(1, step.seq, ids=np.array([12]), probs=np.array([1.0], dtype=np.float32)))
    assert state.generated == [11, 12] and state.layout.logical_len == 4
    reset_for_replay(state)
    assert state.layout.logical_len == 0 and state.prefilling
    chunk1 = plan_step(state, 3)
    assert chunk1.inputs.x.tolist() == [[5, 6, 7]]
    assert apply_reply(state, StepResult(1, chunk1.seq, ids=np.array([0]), probs=np.array([1.0]))) == []
    chunk2 = plan_step(state, 3)
    assert chunk2.inputs.x.tolist() == [[11]]  # the last generated token (12) is not replayed
    assert chunk2.inputs.position_ids.tolist() == [[3]]
    # its reply predicts 12, which the client already has: dropped
    assert apply_reply(state, StepResult(1, chunk2.seq, ids=np.array([12]), probs=np.array([1.0]))) == []
    decode = plan_step(state, 3)
    assert decode.inputs.x.tolist() == [[12]] and decode.inputs.position_ids.tolist() == [[4]]
    events = apply_reply(state, StepResult(1, decode.seq, ids=np.array([13]), probs=np.array([1.0])))
    assert [e.token_id for e in events] == [13] and [e.index for e in events] == [2]
