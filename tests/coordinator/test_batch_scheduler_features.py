"""The paged scheduler one feature at a time: prefix blocks, preemption, refusals, cancel,
micro-batches, speculative verify and rewind, seeded sampling, failed steps, replay."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest

from engine.errors import DeskfleetError, GenerationError
from engine.generation.generator import OverloadedError, UnavailableError
from engine.generation.request import FinishReason, GenerationRequest, SamplingParams
from engine.paged.scheduler import BatchScheduler, Failed, FailOver, Finished
from engine.paged.speculation import SpeculationConfig, Speculator
from engine.paged.step import PagedOutcome
from engine.wire.step_plan import SCRATCH_BLOCKS
from tests.coordinator.paged_sim import (
    EOS,
    VOCAB,
    Run,
    SimPagedModel,
    assert_solo,
    config,
    drive,
    finish_all,
    reference,
    step_once,
)


def test_multi_turn_chat_reuses_the_first_turn_blocks_and_copies_its_partial_block() -> None:
    cfg = config(prefill_chunk=64)
    sched, model, run = BatchScheduler(cfg, fingerprint="m"), SimPagedModel(256, 16), Run()
    turn1 = GenerationRequest(tuple(range(1, 38)), max_new_tokens=10, ignore_eos=True)
    first = sched.add(turn1, {EOS}, 0.0)
    finish_all(sched, model, run)
    answer = run.tokens[first]
    assert answer == reference(turn1, cfg.context_length)
    turn2 = GenerationRequest(turn1.prompt_ids + tuple(answer) + (5, 6, 7), max_new_tokens=8)
    second = sched.add(turn2, {EOS}, 0.0)
    step, _ = sched.next_step()
    assert step is not None
    (row,) = step.plan.rows
    cached = len(turn1.prompt_ids) + len(answer) - 1  # what turn 1 fed (its last token never was)
    assert row.past_len == cached and row.new_tokens == len(turn2.prompt_ids) - cached
    assert cached == 46  # 2 full blocks shared, then 14 tokens of turn 1's last block, copied
    ((src, dst),) = step.plan.copies
    assert row.blocks[2] == dst and src not in row.blocks
    assert [sched.pool.refcount(b) for b in row.blocks] == [1, 1, 1, 1]  # turn 1 is gone: cached blocks revived
    assert sched.metrics()["prefix_hits_total"] == 1
    assert sched.metrics()["prefix_tokens_reused_total"] == cached
    run.take(sched.on_outcome(model.run(step), 0.0))
    finish_all(sched, model, run)
    assert run.tokens[second] == reference(turn2, cfg.context_length)


def test_concurrent_streams_share_a_system_prompt_by_reference() -> None:
    cfg = config(prefill_chunk=64)
    sched, model, run = BatchScheduler(cfg, fingerprint="m"), SimPagedModel(256, 16), Run()
    system = tuple(range(1, 41))  # 2 full blocks of 16, then 8 more tokens
    reqs = [GenerationRequest(system + tail, max_new_tokens=20, ignore_eos=True) for tail in ((3, 4), (9, 9, 9))]
    a = sched.add(reqs[0], {EOS}, 0.0)
    step_once(sched, model, run)  # a's prefill: its full blocks join the index
    b = sched.add(reqs[1], {EOS}, 0.0)
    step, _ = sched.next_step()
    assert step is not None
    rows = {r.stream_id: r for r in step.plan.rows}
    assert rows[b].past_len == 32 and rows[b].blocks[:2] == rows[a].blocks[:2]
    assert all(sched.pool.refcount(blk) == 2 for blk in rows[a].blocks[:2])
    assert step.plan.copies == ()  # the shared part ends on a block boundary: nothing to copy
    run.take(sched.on_outcome(model.run(step), 0.0))
    finish_all(sched, model, run)
    for sid, r in zip((a, b), reqs, strict=True):
        assert run.tokens[sid] == reference(r, cfg.context_length)


def test_a_fully_cached_prompt_still_computes_its_last_token_from_a_copy() -> None:
    cfg = config(prefill_chunk=64)
    sched, model, run = BatchScheduler(cfg, fingerprint="m"), SimPagedModel(256, 16), Run()
    prompt = tuple(range(1, 33))  # exactly 2 blocks
    sched.add(GenerationRequest(prompt + (1,), max_new_tokens=2, ignore_eos=True), {EOS}, 0.0)
    finish_all(sched, model, run)
    again = sched.add(GenerationRequest(prompt, max_new_tokens=3, ignore_eos=True), {EOS}, 0.0)
    step, _ = sched.next_step()
    assert step is not None
    (row,) = step.plan.rows
    assert (row.past_len, row.new_tokens, row.sample) == (31, 1, 1)
    assert len(step.plan.copies) == 1 and step.plan.copies[0][1] == row.blocks[1]
    run.take(sched.on_outcome(model.run(step), 0.0))
    finish_all(sched, model, run)
    assert run.tokens[again] == reference(GenerationRequest(prompt, 3, ignore_eos=True), cfg.context_length)


def test_another_model_never_hits() -> None:
    prompt = tuple(range(1, 50))
    pool = None
    for fingerprint in ("model-a", "model-b"):
        sched = BatchScheduler(config(prefill_chunk=64), fingerprint=fingerprint)
        if pool is not None:  # the same pool, indexed by the other model
            sched.pool, sched.prefix.pool = pool, pool  # type: ignore[union-attr]
        sched.add(GenerationRequest(prompt, max_new_tokens=1), {EOS}, 0.0)
        finish_all(sched, SimPagedModel(256, 16), Run())
        pool = sched.pool
        assert sched.metrics()["prefix_hits_total"] == 0


def test_pool_pressure_preempts_the_most_recent_stream_which_recomputes_exactly() -> None:
    cfg = config(pool_blocks=SCRATCH_BLOCKS + 8, token_budget=64, prefill_chunk=64, prefix_cache=False)
    sched, model, run = BatchScheduler(cfg), SimPagedModel(cfg.pool_blocks, 16), Run()
    reqs = {sched.add(r, {EOS}, 0.0): r for r in
            [GenerationRequest(tuple(range(1 + i, 30 + i)), max_new_tokens=40, ignore_eos=True) for i in range(3)]}
    newest = max(reqs)
    preempted_first = None
    while not sched.idle:
        step_once(sched, model, run)
        if preempted_first is None:
            hit = [sid for sid in reqs if (s := sched.stream(sid)) is not None and s.preemptions]
            preempted_first = hit[0] if hit else None
    assert preempted_first == newest
    assert sched.metrics()["sched_preemptions_total"] >= 1
    for sid, r in reqs.items():
        assert run.tokens[sid] == reference(r, cfg.context_length)


def test_a_stream_that_outgrows_the_whole_pool_fails_clearly() -> None:
    cfg = config(pool_blocks=SCRATCH_BLOCKS + 2, prefill_chunk=64)
    sched, model, run = BatchScheduler(cfg), SimPagedModel(cfg.pool_blocks, 16), Run()
    sid = sched.add(GenerationRequest(tuple(range(1, 30)), max_new_tokens=50, ignore_eos=True), {EOS}, 0.0)
    finish_all(sched, model, run)
    end = run.ends[sid]
    assert isinstance(end, Failed) and isinstance(end.error, GenerationError)
    assert "needs 33 cached positions, 3 KV blocks of 16, more than the whole pool of 2" in str(end.error)
    assert len(run.tokens[sid]) == 32 - 29 + 1  # up to the pool's last position, then the failure
    assert sched.pool.used == 0


def test_requests_that_can_never_run_or_do_not_fit_the_queue_are_refused() -> None:
    sched = BatchScheduler(config(pool_blocks=SCRATCH_BLOCKS + 2, max_streams=1, max_waiting=1, context_length=40))
    with pytest.raises(GenerationError, match="context is 40"):
        sched.add(GenerationRequest(tuple(range(1, 41)), 1), {EOS}, 0.0)
    with pytest.raises(GenerationError, match="need 3 KV blocks of 16 but the pool holds 2"):
        sched.add(GenerationRequest(tuple(range(1, 34)), 1), {EOS}, 0.0)
    sched.add(GenerationRequest((1,), 1), {EOS}, 0.0)
    sched.add(GenerationRequest((2,), 1), {EOS}, 0.0)
    with pytest.raises(OverloadedError, match="retry shortly"):
        sched.add(GenerationRequest((3,), 1), {EOS}, 0.0)
    assert sched.metrics()["requests_rejected_total"] == 1


@pytest.mark.parametrize("bad", [dict(block_size=8), dict(pool_blocks=SCRATCH_BLOCKS), dict(max_streams=0),
                                 dict(token_budget=0), dict(block_size=16, token_budget=600)])
def test_bad_settings_are_refused_by_name(bad) -> None:
    with pytest.raises(DeskfleetError, match="invalid scheduler settings"):
        config(**bad)


def test_cancel_frees_blocks_at_once_or_when_the_step_returns() -> None:
    sched, model, run = BatchScheduler(config(prefill_chunk=64)), SimPagedModel(256, 16), Run()
    waiting = sched.add(GenerationRequest((1, 2), 9), {EOS}, 0.0)
    assert sched.cancel(waiting) == [Finished(waiting, FinishReason.CANCELLED)]
    flying = sched.add(GenerationRequest(tuple(range(1, 20)), 9, ignore_eos=True), {EOS}, 0.0)
    resting = sched.add(GenerationRequest(tuple(range(2, 21)), 9, ignore_eos=True), {EOS}, 0.0)
    step_once(sched, model, run)
    assert sched.pool.used == 4  # 19 tokens each: 2 blocks of 16
    step, _ = sched.next_step(max_rows=1)  # the oldest stream first
    assert step is not None and [r.stream_id for r in step.plan.rows] == [flying]
    assert sched.cancel(resting) == [Finished(resting, FinishReason.CANCELLED)] and sched.pool.used == 2
    assert sched.cancel(flying) == [] and sched.pool.used == 2  # in flight: freed when its step returns
    assert sched.cancel(flying) == []
    actions = sched.on_outcome(model.run(step), 0.0)
    assert actions == [Finished(flying, FinishReason.CANCELLED)] and sched.pool.used == 0 and sched.idle
    assert sched.metrics()["kv_blocks_used"] == 0
    assert (sched.counters["cancelled"], sched.counters["finished"]) == (3, 0)


def test_streams_in_flight_are_in_no_other_step() -> None:
    sched, model = BatchScheduler(config()), SimPagedModel(256, 16)
    for i in range(4):
        sched.add(GenerationRequest((1 + i, 2, 3), 5, ignore_eos=True), {EOS}, 0.0)
    first, _ = sched.next_step(max_rows=2)
    second, _ = sched.next_step(max_rows=2)
    third, _ = sched.next_step()
    assert first is not None and second is not None and third is None
    assert not {r.stream_id for r in first.plan.rows} & {r.stream_id for r in second.plan.rows}
    assert first.seq != second.seq and sched.in_flight == 2
    sched.on_outcome(model.run(first), 0.0)
    again, _ = sched.next_step()
    assert again is not None and {r.stream_id for r in again.plan.rows} == {r.stream_id for r in first.plan.rows}


def test_verify_rows_answer_every_draft_and_rewind_frees_the_surplus_blocks() -> None:
    cfg = config(prefill_chunk=64)
    sched, model, run = BatchScheduler(cfg), SimPagedModel(256, 16), Run()
    request = GenerationRequest(tuple(range(1, 15)), max_new_tokens=30, ignore_eos=True)
    sid = sched.add(request, {EOS}, 0.0)
    step_once(sched, model, run)  # prefill: 14 cached, one token out
    want = reference(request, cfg.context_length)
    assert [s.stream_id for s in sched.wants_drafts()] == [sid]
    wrong = tuple((t + 1) % VOCAB for t in want[1:7])
    step, _ = sched.next_step({sid: (wrong, None)})
    assert step is not None
    (row,) = step.plan.rows
    assert (row.past_len, row.new_tokens, row.sample, len(row.blocks)) == (14, 7, 7, 2)
    assert list(step.token_ids) == [want[0], *wrong]
    run.take(sched.on_outcome(model.run(step), 0.0))
    state = sched.stream(sid)
    assert state is not None and state.cached == 15 and len(state.blocks) == 1 and state.last_accepted == 0
    assert sched.pool.used == 1
    step_once(sched, model, run, {sid: (tuple(want[2:8]), None)})  # all six right: seven tokens
    assert state.last_accepted == 6 and run.tokens[sid] == want[:9] and state.cached == 22
    finish_all(sched, model, run)
    assert run.tokens[sid] == want


def test_seeded_sampling_with_drafts_does_not_depend_on_batch_mates() -> None:
    """Speculative sampling with q distributions: a stream's tokens depend on its own seed and
    drafts only (the drafts here are a function of the stream's own context)."""
    def drafter(state):
        ctx = state.request.prompt_ids + tuple(state.generated)
        g = np.random.default_rng(int(np.asarray(ctx).sum()) + len(ctx))
        q = g.dirichlet(np.ones(VOCAB) * 0.3, size=3)
        return tuple(int(g.choice(VOCAB, p=row)) for row in q), q
    params = [SamplingParams(temperature=0.8, seed=s) for s in (1, 2, 3)]
    reqs = [GenerationRequest(tuple(range(1 + i, 12 + 3 * i)), 20, sampling=p) for i, p in enumerate(params)]
    cfg = config(token_budget=256, prefill_chunk=7)
    solo = []
    for r in reqs:
        run, requests = drive(BatchScheduler(cfg), {0: [r]}, draft=drafter)
        solo.append(run.tokens[next(iter(requests))])
    for arrivals in ({0: reqs}, {0: reqs[2:], 3: reqs[:2]}, {i * 5: [r] for i, r in enumerate(reversed(reqs))}):
        run, requests = drive(BatchScheduler(cfg), arrivals, draft=drafter, in_flight=2)
        for sid, r in requests.items():
            assert run.tokens[sid] == solo[reqs.index(r)]
    assert any(len(set(t)) > 1 for t in solo)


def test_sampled_streams_equal_their_seeded_solo_run() -> None:
    reqs = [GenerationRequest(tuple(range(1 + i, 9 + i)), 25, sampling=SamplingParams(0.7, top_k=10, seed=i))
            for i in range(4)]
    run, requests = drive(BatchScheduler(config(prefill_chunk=3, token_budget=9)),
                          {i: [r] for i, r in enumerate(reqs)}, in_flight=2)
    assert_solo(run, requests, 160)


def test_a_failed_step_asks_for_failover_and_its_rows_are_planned_again() -> None:
    sched, model, run = BatchScheduler(config()), SimPagedModel(256, 16), Run()
    request = GenerationRequest(tuple(range(1, 20)), 6, ignore_eos=True)
    sid = sched.add(request, {EOS}, 0.0)
    step_once(sched, model, run)
    step, _ = sched.next_step()
    assert step is not None
    model.run(step)  # some stages ran it, the reply never came
    actions = sched.on_outcome(PagedOutcome.failed(step.seq, "stage 1 closed the connection"), 0.0)
    assert len(actions) == 1 and isinstance(actions[0], FailOver) and "stage 1 closed" in actions[0].reason
    again, _ = sched.next_step()
    assert again is not None and list(again.token_ids) == list(step.token_ids)
    shape = [[(r.stream_id, r.past_len, r.new_tokens, r.sample) for r in s.plan.rows] for s in (step, again)]
    assert shape[0] == shape[1]
    run.take(sched.on_outcome(model.run(again), 0.0))
    finish_all(sched, model, run)
    assert run.tokens[sid] == reference(request, 160)


def test_a_malformed_reply_is_a_failover_not_a_crash() -> None:
    sched, model = BatchScheduler(config()), SimPagedModel(256, 16)
    sched.add(GenerationRequest((1, 2, 3), 6), {EOS}, 0.0)
    step, _ = sched.next_step()
    assert step is not None
    good = model.run(step)
    bad = PagedOutcome(step.seq, np.zeros(3, np.int64), np.zeros(3, np.float32))
    (action,) = sched.on_outcome(bad, 0.0)
    assert isinstance(action, FailOver) and "3 ids" in action.reason
    assert sched.on_outcome(good, 0.0) == []  # that step is no longer known


def test_replay_rebuilds_every_stream_on_an_empty_pool_and_gives_up_after_max_replays() -> None:
    cfg = config(max_replays=2, prefill_chunk=5)
    sched, model, run = BatchScheduler(cfg, fingerprint="m"), SimPagedModel(256, 16), Run()
    reqs = {sched.add(GenerationRequest(tuple(range(1 + i, 25 + i)), 30, ignore_eos=True), {EOS}, 0.0):
            GenerationRequest(tuple(range(1 + i, 25 + i)), 30, ignore_eos=True) for i in range(3)}
    for _ in range(12):
        step_once(sched, model, run)
    lost, _ = sched.next_step()
    assert lost is not None
    model.lose_everything()
    assert sched.reset_for_replay() == [] and sched.pool.used == 0 and sched.in_flight == 0
    assert sched.on_outcome(model.run(lost), 0.0) == []  # a late reply of the old ring
    step, _ = sched.next_step()
    assert step is not None and all(r.past_len == 0 for r in step.plan.rows)
    run.take(sched.on_outcome(model.run(step), 0.0))
    finish_all(sched, model, run)
    for sid, r in reqs.items():
        assert run.tokens[sid] == reference(r, cfg.context_length)
    # a stream whose ring keeps being lost is failed, with a reason
    sid = sched.add(GenerationRequest((1, 2, 3), 30), {EOS}, 0.0)
    step_once(sched, model, run)
    assert sched.reset_for_replay() == [] and sched.reset_for_replay() == []
    (failed,) = sched.reset_for_replay()
    assert isinstance(failed, Failed) and failed.stream_id == sid and "3 times" in str(failed.error)
    assert sched.idle


def test_fail_all_ends_every_stream_and_frees_the_pool() -> None:
    sched, model, run = BatchScheduler(config(max_streams=2)), SimPagedModel(256, 16), Run()
    sids = [sched.add(GenerationRequest((1 + i, 2, 3), 9), {EOS}, 0.0) for i in range(3)]
    step_once(sched, model, run)
    step, _ = sched.next_step()
    assert step is not None and sched.streams == 3 and sched.running == 2
    error = UnavailableError("no stage answers")
    actions = sched.fail_all(error)
    assert actions == [Failed(sid, error) for sid in sids]
    assert sched.idle and sched.pool.used == 0 and sched.in_flight == 0
    assert sched.on_outcome(model.run(step), 0.0) == []


def test_a_failed_step_that_carried_a_prefix_copy_recomputes_the_copied_part() -> None:
    cfg = config(prefill_chunk=64)
    sched, model, run = BatchScheduler(cfg, fingerprint="m"), SimPagedModel(256, 16), Run()
    turn1 = GenerationRequest(tuple(range(1, 21)), max_new_tokens=4, ignore_eos=True)
    sched.add(turn1, {EOS}, 0.0)
    finish_all(sched, model, run)
    turn2 = GenerationRequest(turn1.prompt_ids + tuple(run.tokens[1]) + (8,), max_new_tokens=5)
    sid = sched.add(turn2, {EOS}, 0.0)
    step, _ = sched.next_step()
    assert step is not None and step.plan.copies and step.plan.rows[0].past_len == 23
    (action,) = sched.on_outcome(PagedOutcome.failed(step.seq, "lost before any stage ran it"), 0.0)
    assert isinstance(action, FailOver)
    again, _ = sched.next_step()
    assert again is not None and again.plan.rows[0].past_len == 16 and again.plan.copies == ()
    run.take(sched.on_outcome(model.run(again), 0.0))
    finish_all(sched, model, run)
    assert run.tokens[sid] == reference(turn2, cfg.context_length)


def test_a_stream_a_chunk_behind_another_with_the_same_prefix_shares_its_blocks_as_they_fill() -> None:
    cfg = config(prefill_chunk=16, token_budget=64)
    sched, model, run = BatchScheduler(cfg, fingerprint="m"), SimPagedModel(256, 16), Run()
    system = tuple(range(1, 81))  # 5 blocks
    ahead = GenerationRequest(system + (1, 2), 6, ignore_eos=True)
    behind = GenerationRequest(system + (3,), 6, ignore_eos=True)
    arrivals = {0: [ahead], 1: [behind]}
    computed: collections.Counter[int] = collections.Counter()
    ids = {}
    for tick in range(200):
        for r in arrivals.get(tick, ()):
            ids[sched.add(r, {EOS}, 0.0)] = r
        step = step_once(sched, model, run)
        if step is not None:
            computed.update({row.stream_id: row.new_tokens for row in step.plan.rows if not row.sample})
        if sched.idle and tick > 1:
            break
    first, second = sorted(ids)
    assert computed[first] == 80  # everything but the last prompt token (the first token's row)
    assert computed[second] < 16  # it rode on the other's blocks as they filled
    assert sched.metrics()["prefix_tokens_reused_total"] == 80
    for sid, r in ids.items():
        assert run.tokens[sid] == reference(r, cfg.context_length)


def test_the_speculator_drafts_for_the_streams_the_scheduler_offers() -> None:
    """The real prompt-lookup Speculator reads the scheduler's streams (DraftSubject) and its
    drafts go through verify rows; greedy tokens stay the solo run's."""
    speculator = Speculator(SpeculationConfig(mode="lookup", k=4))
    cfg = config(prefill_chunk=64)
    sched, model, run = BatchScheduler(cfg), SimPagedModel(256, 16), Run()
    reqs = {sched.add(r, {EOS}, 0.0): r for r in
            [GenerationRequest((5, 6, 7, 8) * 6, 30, ignore_eos=True), GenerationRequest((9, 3) * 9, 30)]}

    async def play() -> None:
        while not sched.idle:
            drafts = {}
            for subject in sched.wants_drafts():
                drafts[subject.stream_id] = await speculator.async_propose(subject)
            step = step_once(sched, model, run, drafts)
            assert step is not None
            for row in step.plan.rows:
                subject = sched.stream(row.stream_id)
                if subject is not None and row.sample:
                    speculator.observe(subject, row.sample - 1, 0.0)

    asyncio.run(play())
    for sid, r in reqs.items():
        assert run.tokens[sid] == reference(r, cfg.context_length)
    assert speculator.proposed > 0 and sched.counters["drafts_accepted"] > 0
    speculator.close()


def test_eviction_takes_a_finished_prefix_from_its_tail() -> None:
    cfg = config(pool_blocks=SCRATCH_BLOCKS + 4, prefill_chunk=64)
    sched, model, run = BatchScheduler(cfg, fingerprint="m"), SimPagedModel(cfg.pool_blocks, 16), Run()
    prompt = tuple(range(1, 50))  # 3 full blocks and one token
    sched.add(GenerationRequest(prompt, 1), {EOS}, 0.0)
    finish_all(sched, model, run)
    assert sched.pool.cached == 4  # 3 full blocks + the partial one, all reusable
    sched.add(GenerationRequest((40, 41, 42) * 5, 1), {EOS}, 0.0)  # another prompt takes one block
    finish_all(sched, model, run)
    again = sched.add(GenerationRequest(prompt[:40] + (9,), 1), {EOS}, 0.0)
    step, _ = sched.next_step()
    assert step is not None and step.plan.rows[0].past_len == 32  # the first two blocks survived
    run.take(sched.on_outcome(model.run(step), 0.0))
    assert run.tokens[again] == reference(GenerationRequest(prompt[:40] + (9,), 1), cfg.context_length)
