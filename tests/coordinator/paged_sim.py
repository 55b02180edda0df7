"""A simulated paged model and a miniature coordinator, for the paged scheduler's tests.

The simulated model keeps a real block pool: each step writes every row's token into the row's
block table at its position, copies ``plan.copies`` first, and predicts from the tokens it
*reads back* through the block table (positions ``0 .. pos``). A block shared that should not
be, a copy forgotten, a rewind that frees a live block or a block handed to two streams all
change what the model reads, hence the stream's tokens. The reference is a plain loop over the
same prediction function, independent of the scheduler. :func:`drive` plays a schedule (joins,
micro-batches, cancels, failed steps, lost rings, next chat turns) and checks the block
accounting after every step and outcome.
"""

from __future__ import annotations

import collections
import functools
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.generation.request import FinishReason, GenerationRequest
from engine.generation.sampling import choose, make_rng
from engine.paged.scheduler import (
    BatchScheduler,
    Emit,
    Failed,
    FailOver,
    Finished,
    SchedulerConfig,
)
from engine.paged.step import PagedOutcome, PagedStep
from engine.wire.step_plan import blocks_needed

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
