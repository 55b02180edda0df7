"""The paged scheduler under many batch compositions: every stream's tokens equal its solo run.

An enumerated set (joins at different steps, prefill chunks of 1/5/16, 1..8 streams) and 200
seeded random schedules (micro-batches, cancellations, small pools that preempt, right and wrong
drafts, shared system prompts and next chat turns that hit the prefix cache, failed steps, lost
rings that replay), against the simulated paged model of :mod:`tests.coordinator.paged_sim`.
"""

from __future__ import annotations

import collections
import random

import pytest

from engine.generation.generator import UnavailableError
from engine.generation.request import GenerationRequest, SamplingParams
from engine.paged.scheduler import BatchScheduler, Failed, SchedulerConfig
from engine.wire.step_plan import SCRATCH_BLOCKS, blocks_needed
from tests.coordinator.paged_sim import (
    EOS,
    VOCAB,
    DraftPolicy,
    SimPagedModel,
    assert_solo,
    config,
    drive,
    prompts,
    reference,
)

# ----------------------------------------------------------------------------- enumerated compositions


@pytest.mark.parametrize("chunk", [1, 5, 16])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_batched_greedy_equals_solo_for_joins_chunks_and_sizes(n: int, chunk: int) -> None:
    rnd = random.Random(n * 100 + chunk)
    for joins in ("together", "staggered", "late"):
        ps = prompts(rnd, n)
        reqs = [GenerationRequest(p, max_new_tokens=rnd.randrange(1, 30)) for p in ps]
        if joins == "together":
            arrivals = {0: reqs}
        elif joins == "staggered":
            arrivals = {2 * i: [r] for i, r in enumerate(reqs)}
        else:
            arrivals = {0: reqs[:1], 9: reqs[1:]}
        cfg = config(prefill_chunk=chunk, token_budget=max(chunk, 8))
        run, requests = drive(BatchScheduler(cfg), arrivals)
        assert_solo(run, requests, cfg.context_length)


def test_a_long_prefill_does_not_stall_decoding_streams() -> None:
    sched = BatchScheduler(config(token_budget=12, prefill_chunk=8))
    short = sched.add(GenerationRequest((1, 2, 3), max_new_tokens=20), {EOS}, 0.0)
    model = SimPagedModel(256, 16)
    step, _ = sched.next_step()
    assert step is not None
    sched.on_outcome(model.run(step), 0.0)
    sched.add(GenerationRequest(tuple(range(1, 40)), max_new_tokens=3, ignore_eos=True), {EOS}, 0.0)
    step, _ = sched.next_step()
    assert step is not None
    rows = {r.stream_id: r for r in step.plan.rows}
    assert rows[short].new_tokens == 1 and rows[short].sample == 1  # decode first
    long_row = next(r for sid, r in rows.items() if sid != short)
    assert long_row.new_tokens == 8 and long_row.sample == 0  # a chunk within what the budget left
    assert step.plan.tokens <= 12


# ----------------------------------------------------------------------------- seeded random schedules


def _random_case(seed: int):
    rnd = random.Random(seed)
    small_pool = rnd.random() < 0.5
    bs, context = rnd.choice([16, 32]), rnd.randrange(96, 161)
    # a small pool still holds any one stream (a stream alone too big fails, tested apart)
    pool = SCRATCH_BLOCKS + blocks_needed(context, bs) + rnd.randrange(0, 3) if small_pool else 256
    cfg = config(block_size=bs, pool_blocks=pool, context_length=context,
                 max_streams=rnd.randrange(1, 9), token_budget=rnd.choice([8, 16, 40, 96]),
                 prefill_chunk=rnd.choice([1, 5, 16, 64]), prefix_cache=rnd.random() < 0.8)
    system = tuple(rnd.randrange(1, VOCAB) for _ in range(rnd.choice([0, 20, 40])))
    arrivals: dict[int, list[GenerationRequest]] = collections.defaultdict(list)
    for _ in range(rnd.randrange(4 if small_pool else 1, 9)):
        sampling = SamplingParams(temperature=0.9, top_k=rnd.choice([0, 8]), seed=rnd.randrange(1000)) \
            if rnd.random() < 0.3 else SamplingParams()
        prompt = prompts(rnd, 1, system if rnd.random() < 0.6 else ())[0]
        tick = rnd.randrange(0, 25 if rnd.random() < 0.5 else 4)
        stop = (rnd.randrange(1, VOCAB),) if rnd.random() < 0.2 else ()
        arrivals[tick].append(GenerationRequest(prompt, max_new_tokens=rnd.randrange(1, 40), sampling=sampling,
                                                stop_token_ids=stop, want_logits=rnd.random() < 0.2))
    return rnd, cfg, arrivals


def _drafter(rnd: random.Random, cfg: SchedulerConfig) -> DraftPolicy:
    """Right drafts (the solo run's next tokens), wrong ones, or a mix; none for sampled streams."""
    def propose(state) -> tuple[tuple[int, ...], None]:
        if not state.request.sampling.greedy:
            return (), None
        want = reference(state.request, cfg.context_length)[len(state.generated):]
        k = rnd.randrange(0, 7)
        good = want[:k] + [rnd.randrange(VOCAB) for _ in range(k - len(want[:k]))]
        cut = rnd.randrange(0, k + 1)
        return tuple(good[:cut] + [(t + 1) % VOCAB for t in good[cut:]]), None
    return propose


@pytest.mark.parametrize("block", range(8))
def test_random_schedules_equal_solo_runs(block: int) -> None:
    """200 seeded schedules (25 per case): joins, micro-batches, cancellations, small pools
    (preemption), drafts right and wrong, shared system prompts and next chat turns (prefix hits),
    failed steps and lost rings (replays)."""
    for seed in range(block * 25, block * 25 + 25):
        rnd, cfg, arrivals = _random_case(seed)
        sched = BatchScheduler(cfg, fingerprint="sim")
        run, requests = drive(sched, arrivals, in_flight=rnd.choice([1, 2, 3]), rnd=rnd,
                              draft=_drafter(rnd, cfg) if rnd.random() < 0.5 else None,
                              cancel_p=rnd.choice([0.0, 0.0, 0.05]), fail_p=rnd.choice([0.0, 0.0, 0.05]),
                              replay_p=rnd.choice([0.0, 0.0, 0.03]), follow_p=rnd.choice([0.0, 0.5]),
                              max_rows=rnd.choice([None, None, 2]))
        replays_failed = {sid for sid, e in run.ends.items() if isinstance(e, Failed)}
        for sid in replays_failed:  # only a stream that lost its ring too often may fail
            assert isinstance(run.ends[sid].error, UnavailableError)
            del requests[sid]
        assert_solo(run, requests, cfg.context_length, cancelled_ok=True)
