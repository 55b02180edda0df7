"""The paged scheduler against a simulated paged model: every stream's tokens equal its solo run.

The simulated model keeps a real block pool: each step writes every row's token into the row's
block table at its position, copies ``plan.copies`` first, and predicts from the tokens it
*reads back* through the block table (positions ``0 .. pos``). A block shared that should not
be, a copy forgotten, a rewind that frees a live block or a block handed to two streams all
change what the model reads, hence the stream's tokens. The reference is a plain loop over the
same prediction function, independent of the scheduler. Invariants of the block accounting are
checked after every step.
"""

from __future__ import annotations

import collections
import functools
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from engine.coordinator.batch_scheduler import (
    BatchScheduler,
    Emit,
    Failed,
    FailOver,
    Finished,
    SchedulerConfig,
)
from engine.errors import DeskfleetError, GenerationError
from engine.generation.generator import OverloadedError, UnavailableError
from engine.generation.request import FinishReason, GenerationRequest, SamplingParams
from engine.generation.sampling import choose, make_rng
from engine.shards.paged_step import PagedOutcome, PagedStep
from engine.wire.step_plan import SCRATCH_BLOCKS, blocks_needed

VOCAB = 48
EOS = 0
_TABLE = np.random.default_rng(1234).standard_normal((4099, VOCAB)).astype(np.float32) * 3.0
_WEIGHTS = np.random.default_rng(99).integers(1, 1 << 30, size=4096, dtype=np.int64)


def logits_of(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """The simulated model: logits [V] after the whole sequence ``tokens`` (order and position matter)."""
    seq = np.asarray(tokens, dtype=np.int64)
    h = int((seq * _WEIGHTS[: len(seq)]).sum() + 7 * len(seq)) % _TABLE.shape[0]
    return _TABLE[h]


def top1(logits: np.ndarray) -> tuple[int, float]:
    p = np.exp(logits - logits.max())
    return int(logits.argmax()), float(p.max() / p.sum())


def reference(request: GenerationRequest, context_length: int, eos: frozenset[int] = frozenset({EOS})) -> list[int]:
    """The stream decoded alone, one token per step, by the rules the scheduler keeps."""
    return list(_reference(request, context_length, eos))


@functools.lru_cache(maxsize=4096)
def _reference(request: GenerationRequest, context_length: int, eos: frozenset[int]) -> tuple[int, ...]:
    seq, out = list(request.prompt_ids), []
    rng = make_rng(request.sampling)
    while True:
        token, _ = choose(logits_of(seq), request.sampling, rng)
        out.append(token)
        seq.append(token)
        if not request.ignore_eos and (token in eos or token in request.stop_token_ids):
            return tuple(out)
        if len(out) >= request.max_new_tokens or len(seq) >= context_length:
            return tuple(out)


class SimPagedModel:
    """Runs plans on a simulated KV pool of token ids [pool_blocks, block_size]."""

    def __init__(self, pool_blocks: int, block_size: int):
        self.block_size = block_size
        self.kv = np.full((pool_blocks, block_size), -1, dtype=np.int64)
        self.junk = np.random.default_rng(5)

    def lose_everything(self) -> None:
        """A new ring: whatever the pool holds is garbage."""
        self.kv[:] = self.junk.integers(0, VOCAB, size=self.kv.shape)

    def run(self, step: PagedStep) -> PagedOutcome:
        plan, bs = step.plan, self.block_size
        assert step.token_ids.dtype == np.int64 and step.token_ids.shape == (plan.tokens,)
        for src, dst in plan.copies:
            self.kv[dst] = self.kv[src]
        begin = 0
        for row in plan.rows:  # write every row's KV first (one infer: rows attend causally within a stream)
            for j in range(row.new_tokens):
                pos = row.past_len + j
                self.kv[row.blocks[pos // bs], pos % bs] = step.token_ids[begin + j]
            begin += row.new_tokens
        pad = plan.padded_tokens - plan.tokens  # the padding subsequence scribbles on the scratch blocks
        for j in range(pad):
            self.kv[j // bs, j % bs] = self.junk.integers(VOCAB)
        ids, probs, logits = [], [], []
        for row in plan.rows:
            table = np.asarray(row.blocks)
            for j in range(row.new_tokens - row.sample, row.new_tokens):
                pos = np.arange(row.past_len + j + 1)
                lg = logits_of(self.kv[table[pos // bs], pos % bs])
                token, prob = top1(lg)
                ids.append(token)
                probs.append(prob)
                if row.want_logits:
                    logits.append(lg)
        return PagedOutcome(step.seq, np.asarray(ids, np.int64), np.asarray(probs, np.float32),
                            np.stack(logits) if logits else None, stage_ms=(0.1,))


def check_accounting(sched: BatchScheduler) -> None:
    """The block accounting invariants: run after every step and outcome."""
    pool = sched.pool
    pool.audit()
    assert pool.free + pool.used == pool.capacity
    holders: collections.Counter[int] = collections.Counter()
    for sid, blocks in sched.block_tables().items():
        assert len(set(blocks)) == len(blocks), f"stream {sid} lists a block twice"
        holders.update(blocks)
        state = sched.stream(sid)
        assert state is not None
        if state.in_flight is None:
            assert len(blocks) == blocks_needed(state.cached, sched.config.block_size)
    for b, n in holders.items():
        assert pool.refcount(b) == n, f"block {b}: refcount {pool.refcount(b)}, held by {n}"
    assert pool.used == len(holders), "a block is held by no stream"  # audit(): held + free + cached = pool


def check_step(sched: BatchScheduler, step: PagedStep) -> None:
    """A step writes only into blocks its stream alone holds; copies land in such blocks."""
    bs = sched.config.block_size
    written = set()
    for row in step.plan.rows:
        assert row.past_len + row.new_tokens <= sched.config.context_length
        first = row.past_len // bs
        for b in row.blocks[first:]:
            assert sched.pool.refcount(b) == 1, f"stream {row.stream_id} writes into shared block {b}"
            written.add(b)
    for src, dst in step.plan.copies:
        assert dst in written and src not in written


@dataclass
class Run:
    """What a driven schedule produced, per stream id."""

    tokens: dict[int, list[int]] = field(default_factory=lambda: collections.defaultdict(list))
    ends: dict[int, Finished | Failed] = field(default_factory=dict)
    failovers: int = 0

    def take(self, actions) -> None:
        for a in actions:
            if isinstance(a, Emit):
                assert a.stream_id not in self.ends
                assert a.event.index == len(self.tokens[a.stream_id])
                self.tokens[a.stream_id].append(a.event.token_id)
            elif isinstance(a, Finished | Failed):
                assert a.stream_id not in self.ends, f"stream {a.stream_id} ended twice"
                self.ends[a.stream_id] = a
            else:
                assert isinstance(a, FailOver)
                self.failovers += 1


DraftPolicy = Callable[[object], tuple[tuple[int, ...], np.ndarray | None]]


def drive(sched: BatchScheduler, arrivals: dict[int, list[GenerationRequest]], *, in_flight: int = 1,
          rnd: random.Random | None = None, draft: DraftPolicy | None = None, cancel_p: float = 0.0,
          fail_p: float = 0.0, replay_p: float = 0.0, max_rows: int | None = None, follow_p: float = 0.0,
          max_ticks: int = 5000) -> tuple[Run, dict[int, GenerationRequest]]:
    """A coordinator in miniature: requests join at their tick, up to ``in_flight`` steps are out,
    outcomes come back in order; optionally cancels, failed steps (re-planned), lost rings
    (replayed) and next turns of finished chats (prompt + answer + more)."""
    model = SimPagedModel(sched.config.pool_blocks, sched.config.block_size)
    rnd = rnd or random.Random(0)
    run, requests = Run(), {}
    out: collections.deque[tuple[PagedStep, PagedOutcome]] = collections.deque()
    for tick in itertools.count():
        assert tick < max_ticks, "the schedule does not finish"
        for request in arrivals.get(tick, ()):
            requests[sched.add(request, {EOS}, float(tick))] = request
        if cancel_p and rnd.random() < cancel_p:
            live = [sid for sid in requests if sid not in run.ends]
            if live:
                run.take(sched.cancel(rnd.choice(live)))
                check_accounting(sched)
        if replay_p and out and rnd.random() < replay_p:
            late = out.popleft() if rnd.random() < 0.5 else None
            out.clear()
            model.lose_everything()
            run.take(sched.reset_for_replay())
            if late is not None:  # an outcome of the lost ring arriving after all: ignored
                assert sched.on_outcome(late[1], float(tick)) == []
            check_accounting(sched)
        while len(out) < in_flight:
            drafts = {s.stream_id: draft(s) for s in sched.wants_drafts()} if draft else None
            step, actions = sched.next_step(drafts, max_rows=max_rows)
            run.take(actions)
            if step is None:
                break
            check_step(sched, step)
            if fail_p and rnd.random() < fail_p:  # the step ran on every stage but the reply was lost, or on none
                if rnd.random() < 0.5:
                    model.run(step)
                outcome = PagedOutcome.failed(step.seq, "a stage dropped the step")
            else:
                outcome = model.run(step)
            out.append((step, outcome))
            check_accounting(sched)
        if not out:
            if all(tick >= t for t in arrivals) and sched.idle:
                break
            continue
        _, outcome = out.popleft()
        actions = sched.on_outcome(outcome, float(tick))
        run.take(actions)
        check_accounting(sched)
        for a in actions:
            if follow_p and isinstance(a, Finished) and a.reason is not FinishReason.CANCELLED \
                    and rnd.random() < follow_p:
                prompt = requests[a.stream_id].prompt_ids + tuple(run.tokens[a.stream_id]) + (1, 2)
                if len(prompt) < sched.config.context_length - 1:
                    arrivals.setdefault(tick + 1, []).append(GenerationRequest(prompt, rnd.randrange(1, 20)))
    assert sched.pool.used == 0 and sched.in_flight == 0
    assert set(run.ends) == set(requests)
    return run, requests


def config(**kwargs) -> SchedulerConfig:
    base = dict(block_size=16, pool_blocks=256, max_streams=8, max_waiting=32, token_budget=64,
                prefill_chunk=16, context_length=160)
    base.update(kwargs)
    return SchedulerConfig(**base)


def prompts(rnd: random.Random, n: int, shared: Sequence[int] = ()) -> list[tuple[int, ...]]:
    return [tuple(shared) + tuple(rnd.randrange(1, VOCAB) for _ in range(rnd.randrange(1, 40))) for _ in range(n)]


def assert_solo(run: Run, requests: dict[int, GenerationRequest], context_length: int,
                cancelled_ok: bool = False) -> None:
    for sid, request in requests.items():
        want = reference(request, context_length)
        end = run.ends[sid]
        got = run.tokens[sid]
        if isinstance(end, Finished) and end.reason is FinishReason.CANCELLED:
            assert cancelled_ok and got == want[: len(got)], f"stream {sid}"
            continue
        assert isinstance(end, Finished), f"stream {sid} failed: {getattr(end, 'error', None)}"
        assert got == want, f"stream {sid}: {got} != solo {want}"
        expected = FinishReason.STOP if want[-1] in (EOS, *request.stop_token_ids) else FinishReason.LENGTH
        assert end.reason is expected


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


# ----------------------------------------------------------------------------- one feature at a time


def step_once(sched: BatchScheduler, model: SimPagedModel, run: Run, drafts=None) -> PagedStep | None:
    step, actions = sched.next_step(drafts)
    run.take(actions)
    if step is not None:
        check_step(sched, step)
        run.take(sched.on_outcome(model.run(step), 0.0))
        check_accounting(sched)
    return step


def finish_all(sched: BatchScheduler, model: SimPagedModel, run: Run) -> None:
    for _ in range(10_000):
        if step_once(sched, model, run) is None:
            assert sched.idle
            return
    raise AssertionError("did not finish")


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
    a = sched.add(GenerationRequest(system + (3, 4), max_new_tokens=20, ignore_eos=True), {EOS}, 0.0)
    step_once(sched, model, run)  # a's prefill: its full blocks join the index
    b = sched.add(GenerationRequest(system + (9, 9, 9), max_new_tokens=20, ignore_eos=True), {EOS}, 0.0)
    step, _ = sched.next_step()
    assert step is not None
    rows = {r.stream_id: r for r in step.plan.rows}
    assert rows[b].past_len == 32 and rows[b].blocks[:2] == rows[a].blocks[:2]
    assert all(sched.pool.refcount(blk) == 2 for blk in rows[a].blocks[:2])
    assert step.plan.copies == ()  # the shared part ends on a block boundary: nothing to copy
    run.take(sched.on_outcome(model.run(step), 0.0))
    finish_all(sched, model, run)
    for sid in (a, b):
        assert run.tokens[sid] == reference(sched_request(run, sid, system), cfg.context_length)


def sched_request(run: Run, sid: int, system: tuple[int, ...]) -> GenerationRequest:
    tail = (3, 4) if sid == 1 else (9, 9, 9)
    return GenerationRequest(system + tail, max_new_tokens=20, ignore_eos=True)


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
    assert sched.metrics()["sched_rejected_total"] == 1


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
