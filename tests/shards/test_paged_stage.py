"""Paged stages against today's stateful stages: the same greedy tokens for every stream whatever
shares its steps (joins at different steps, prefill chunks beside decode, speculative verify and
rewind, copy-on-write of a partial block, blocks moved), padding that changes no real row, the
pool budget, and the pure PagedAttention inputs of a plan."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from engine.generation.in_process import greedy_generate
from engine.paged.stage import (
    SAMPLED,
    LMHeadNotFoundError,
    LocalPagedPath,
    PagedStage,
    PagedStageError,
    PoolBudgetError,
    PoolNotAllocatedError,
    _logits_head,
    paged_inputs,
    pool_tensor,
    top1_reply,
)
from engine.paged.step import PagedStep
from engine.shards.stage import LocalChain
from engine.shards.step_answer import top1
from engine.wire.step_plan import SCRATCH_BLOCKS, PlanRow, StepPlan, blocks_needed, plan
from tests.conftest import PROMPT_IDS
from tests.support.cpu_needs import needs_cpu

BS = 32
POOL = 48
BUDGET = 1 << 30
N = 10  # generated tokens per stream


@pytest.fixture(scope="module")
def paged(tiny_export):
    """``paged(stages, family)`` -> the compiled PagedStages of a tiny model split that way (exact settings)."""
    built: dict[tuple[int, str], list[PagedStage]] = {}

    def get(stages: int, family: str = "llama") -> list[PagedStage]:
        if (stages, family) not in built:
            built[stages, family] = LocalPagedPath.load(tiny_export(family, stages), SCRATCH_BLOCKS + 1, BUDGET,
                                                        exact=True).stages
        return built[stages, family]

    return get


@pytest.fixture(scope="module")
def reference(tiny_export):
    """``reference(stages, prompt, n, family)`` -> greedy tokens of the stateful chain, the stream alone."""
    chains: dict[tuple[int, str], LocalChain] = {}

    def get(stages: int, prompt, n: int = N, family: str = "llama") -> tuple[int, ...]:
        if (stages, family) not in chains:
            chains[stages, family] = LocalChain.load(tiny_export(family, stages), exact=True)
        return greedy_generate(chains[stages, family], list(prompt), n, ignore_eos=True).tokens

    return get


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(14)
    return [list(PROMPT_IDS), rng.integers(3, vocab, 40).tolist(), rng.integers(3, vocab, 5).tolist(),
            rng.integers(3, vocab, 23).tolist()]


class Blocks:
    """A free list handing out stream blocks in a scrambled order (tables are never contiguous)."""

    def __init__(self, pool: int = POOL):
        self.free = list(np.random.default_rng(3).permutation(np.arange(SCRATCH_BLOCKS, pool)))
        self.returned = 0

    def take(self) -> int:
        return int(self.free.pop())


@dataclasses.dataclass
class Stream:
    sid: int
    seq: list[int]  # prompt + generated
    prompt_len: int
    join: int = 0
    chunk: int | None = None
    past: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    drafts: list[int] = dataclasses.field(default_factory=list)  # proposed for this step

    def __post_init__(self) -> None:
        self.seq = list(self.seq)  # never the caller's prompt list

    @property
    def generated(self) -> list[int]:
        return self.seq[self.prompt_len:]

    def feed(self) -> list[int]:
        todo = self.seq[self.past:]
        if self.past < self.prompt_len and self.chunk:
            todo = todo[:self.chunk]
        return todo + self.drafts


def step(path: LocalPagedPath, streams: list[Stream], pool: Blocks, seq: int = 0, copies=()):
    """One paged step over ``streams``: allocate blocks, run, then advance each stream by what the
    last stage answered (greedy; drafts accepted while they match, past_len lowered past the rest)."""
    rows, ids = [], []
    for s in streams:
        feed = s.feed()
        while len(s.blocks) < blocks_needed(s.past + len(feed), BS):
            s.blocks.append(pool.take())
        answers = len(s.seq) == s.past + len(feed) - len(s.drafts)
        rows.append(PlanRow(s.sid, s.past, len(feed), tuple(s.blocks), sample=(1 + len(s.drafts)) if answers else 0))
        ids += feed
    p = plan(BS, POOL, rows, copies=tuple(copies))
    out = path.run(PagedStep(seq, p, np.asarray(ids, dtype=np.int64)))
    at = 0
    for s, row in zip(streams, rows, strict=True):
        got = out.ids[at:at + row.sample].tolist()
        at += row.sample
        if not row.sample:
            s.past += row.new_tokens
            continue
        accepted = 0
        while accepted < len(s.drafts) and s.drafts[accepted] == got[accepted]:
            accepted += 1
        s.seq += s.drafts[:accepted] + [got[accepted]]
        s.past += row.new_tokens - len(s.drafts) + accepted  # rewind: rejected drafts leave the cache
        keep = blocks_needed(s.past, BS)
        pool.free += s.blocks[keep:]  # surplus blocks go back: the next block taken is one of them
        pool.returned += len(s.blocks[keep:])
        del s.blocks[keep:]
        s.drafts = []
    assert at == len(out.ids)
    return out


def drive(path: LocalPagedPath, streams: list[Stream], n: int = N, spec=None,
          pool: Blocks | None = None) -> dict[int, list[int]]:
    """Steps until every stream has ``n`` tokens; ``spec(stream, step) -> drafts`` proposes drafts."""
    pool, done, t = pool or Blocks(), {}, 0
    while len(done) < len(streams):
        live = [s for s in streams if s.join <= t and s.sid not in done]
        for s in live:
            if spec is not None and s.past == len(s.seq) - 1 and s.generated:
                s.drafts = spec(s, t)
        if live:
            step(path, live, pool, t)
        for s in live:
            if len(s.generated) >= n:
                done[s.sid] = s.generated[:n]
        t += 1
    return done


@pytest.mark.parametrize(("family", "stages"), [("llama", 1), ("llama", 2), ("qwen2", 2)])
def test_batched_streams_give_each_streams_tokens_alone(family, stages, paged, reference):
    path = LocalPagedPath(paged(stages, family), POOL, BUDGET)
    ps = prompts(path.manifest.model.vocab_size)
    streams = [Stream(1, ps[0], len(ps[0])), Stream(2, ps[1], len(ps[1]), join=0, chunk=5),
               Stream(3, ps[2], len(ps[2]), join=2), Stream(4, ps[3], len(ps[3]), join=5, chunk=5)]
    got = drive(path, streams)
    for s, prompt in zip(streams, ps, strict=True):
        assert tuple(got[s.sid]) == reference(stages, prompt, family=family), f"stream {s.sid}"


@pytest.mark.parametrize("stages", [1, 2])
def test_speculative_verify_and_rewind_keep_greedy_tokens(stages, paged, reference):
    path = LocalPagedPath(paged(stages), POOL, BUDGET)
    ps = prompts(path.manifest.model.vocab_size)
    refs = {i + 1: reference(stages, p, N + 8) for i, p in enumerate(ps)}
    vocab = path.manifest.model.vocab_size
    proposals = []

    def spec(s: Stream, t: int) -> list[int]:
        if s.sid not in (1, 4) or t % 2:
            return []
        k = len(s.generated)
        right = len(proposals) % 4  # 0..3 correct drafts, then wrong ones: a verify row of 1 + 3
        truth = list(refs[s.sid][k:k + 3])
        drafts = truth[:right] + [(x + 1) % vocab for x in truth[right:]]
        proposals.append(right)
        return drafts

    streams = [Stream(i + 1, p, len(p), join=i, chunk=5 if i % 2 else None) for i, p in enumerate(ps)]
    pool = Blocks()
    got = drive(path, streams, spec=spec, pool=pool)
    assert len(pool.free) + sum(len(s.blocks) for s in streams) == POOL - SCRATCH_BLOCKS
    assert pool.returned  # a rejected verify crossed a block boundary and gave the new block back
    assert 0 in proposals and 1 in proposals  # all-wrong and partly right verifies both ran
    for s in streams:
        assert tuple(got[s.sid]) == refs[s.sid][:N], f"stream {s.sid}"


def test_copy_on_write_fork_continues_like_the_original(paged, reference):
    path = LocalPagedPath(paged(2), POOL, BUDGET)
    prompt = prompts(path.manifest.model.vocab_size)[1]  # 40 tokens: one full block, one partial
    pool = Blocks()
    a = Stream(1, list(prompt), len(prompt))
    for t in range(4):
        step(path, [a], pool, t)
    assert a.past % BS and len(a.blocks) == 2
    b = Stream(2, list(a.seq), len(prompt), past=a.past, blocks=[a.blocks[0], pool.take()])  # shares block 0
    copies = [(a.blocks[1], b.blocks[1])]
    for t in range(4, 4 + N - 4):
        step(path, [a, b], pool, t, copies)
        copies = []
    assert a.generated == b.generated == list(reference(2, prompt))


def test_blocks_moved_to_other_ids_continue_the_stream(paged, reference):
    path = LocalPagedPath(paged(2), POOL, BUDGET)
    prompt = prompts(path.manifest.model.vocab_size)[3]
    pool = Blocks()
    s = Stream(1, list(prompt), len(prompt))
    for t in range(3):
        step(path, [s], pool, t)
    moved = [pool.take() for _ in s.blocks]
    for stage in path.stages:
        stage.import_blocks(moved, stage.export_blocks(s.blocks))
        for arr in stage.caches:
            arr[s.blocks] = 0  # the old copies are gone
    s.blocks = moved
    for t in range(3, N):
        step(path, [s], pool, t)
    assert s.generated == list(reference(2, prompt))


@pytest.mark.parametrize("stages", [1, 2])
def test_padding_rows_change_no_real_row(stages, paged):
    path = LocalPagedPath(paged(stages), POOL, BUDGET)
    ps = prompts(path.manifest.model.vocab_size)
    rows = [PlanRow(1, 0, 5, (7,), sample=5, want_logits=True), PlanRow(2, 0, 4, (9,), sample=2, want_logits=True)]
    ids = np.asarray(ps[3][:5] + ps[0][:4], dtype=np.int64)
    outs, hidden = [], []
    for padded in (9, 16, 9 + 3 * BS):  # no padding, the bucket, padding over three scratch blocks
        p = plan(BS, POOL, rows, padded_tokens=padded)
        outs.append(path.run(PagedStep(0, p, ids)))
        if stages > 1:
            hidden.append(path.stages[0].run(p, np.concatenate([ids, np.zeros(padded - 9, np.int64)])))
            assert hidden[-1].shape == (padded, path.manifest.model.hidden_size)
    for out in outs[1:]:
        assert out.ids.tolist() == outs[0].ids.tolist()
        np.testing.assert_allclose(out.logits, outs[0].logits, rtol=0, atol=1e-4)
    for h in hidden[1:]:
        np.testing.assert_allclose(h[:9], hidden[0], rtol=0, atol=1e-5)


def test_a_step_answering_no_row(paged):
    path = LocalPagedPath(paged(2), POOL, BUDGET)
    chunk = plan(BS, POOL, [PlanRow(1, 0, 5, (5,), sample=0)])
    out = path.run(PagedStep(0, chunk, np.arange(3, 8, dtype=np.int64)))
    assert out.ids.shape == (0,) and out.probs.shape == (0,) and out.logits is None
    assert path.stages[-1].run(chunk, np.zeros((8, path.manifest.model.hidden_size), np.float32)).shape == (
        0, path.manifest.model.vocab_size)


def test_logits_only_for_the_streams_that_want_them(paged):
    path = LocalPagedPath(paged(1), POOL, BUDGET)
    rows = [PlanRow(1, 0, 3, (5,), sample=2, want_logits=True), PlanRow(2, 0, 2, (6,)),
            PlanRow(3, 0, 1, (8,), want_logits=True)]
    p = plan(BS, POOL, rows)
    out = path.run(PagedStep(0, p, np.asarray([5, 6, 7, 8, 9, 10])))
    assert out.ids.shape == (4,) and out.logits is not None and out.logits.shape == (3, path.manifest.model.vocab_size)
    assert out.logits.argmax(axis=-1).tolist() == [out.ids[0], out.ids[1], out.ids[3]]


def test_pool_over_budget_is_refused(paged):
    stage = paged(2)[0]
    need = 40 * stage.block_bytes
    with pytest.raises(PoolBudgetError, match=f"{need} bytes.*{need - 1} bytes"):
        stage.allocate(40, need - 1)
    stage.allocate(40, need)
    assert [arr.shape[0] for arr in stage.caches] == [40] * len(stage.caches)
    assert sum(arr.nbytes for arr in stage.caches) == need
    with pytest.raises(PoolNotAllocatedError, match="48 blocks"):
        stage.run(plan(BS, 48, [PlanRow(1, 0, 1, (5,))]), np.zeros(1, np.int64))


def test_the_pool_takes_the_cache_layout_the_plugin_compiled(tiny_export):
    """u8 caches carry scale and zero-point rows (keys) and columns (values): shapes and types come
    from the compiled model, never from the block size; a u4 cache has no numpy pool and is refused."""
    export = tiny_export("llama", 1)
    stage = PagedStage(export, 0, properties={"KV_CACHE_PRECISION": "u8"})
    path = LocalPagedPath([stage], 8, BUDGET)
    key, value = stage.caches[:2]
    assert key.dtype == value.dtype == np.uint8 and key.shape[2] > BS and value.shape[2] == BS
    assert stage.block_bytes == sum(arr[0].nbytes for arr in stage.caches)
    out = path.run(PagedStep(0, plan(BS, 8, [PlanRow(1, 0, 3, (5,))]), np.asarray([4, 5, 6])))
    assert out.ids.shape == (1,) and 0 < out.probs[0] <= 1
    with pytest.raises(PagedStageError, match="u4 KV cache"):
        PagedStage(export, 0, properties={"KV_CACHE_PRECISION": "u4"}).allocate(8, BUDGET)


def test_paged_inputs_of_a_plan():
    p = plan(BS, POOL, [PlanRow(1, 0, 3, (4,), sample=1), PlanRow(2, 33, 1, (5, 6))], padded_tokens=8)
    got = paged_inputs(p, sampled=True)
    assert got["position_ids"].tolist() == [0, 1, 2, 33, 0, 1, 2, 3]
    assert got["past_lens"].tolist() == [0, 33, 0]
    assert got["subsequence_begins"].tolist() == [0, 3, 4, 8]
    assert got["block_indices"].tolist() == [4, 5, 6, 0]
    assert got["block_indices_begins"].tolist() == [0, 1, 3, 4]
    assert got["max_context_len"].shape == () and int(got["max_context_len"]) == 34
    assert got[SAMPLED].tolist() == [2, 3]
    assert {k: v.dtype for k, v in got.items()} == {
        "position_ids": np.int64, "past_lens": np.int32, "subsequence_begins": np.int32, "block_indices": np.int32,
        "block_indices_begins": np.int32, "max_context_len": np.int32, SAMPLED: np.int64}
    # no padding: no extra subsequence; a long padding spans several scratch blocks
    exact = paged_inputs(plan(BS, POOL, [PlanRow(1, 0, 3, (4,), sample=3)], padded_tokens=3), sampled=True)
    assert exact["past_lens"].tolist() == [0] and exact["subsequence_begins"].tolist() == [0, 3]
    assert exact[SAMPLED].tolist() == [0, 1, 2]
    long = paged_inputs(plan(BS, POOL, [PlanRow(1, 40, 2, (4, 7))], padded_tokens=2 + 70))
    assert long["block_indices"].tolist() == [4, 7, 0, 1, 2] and SAMPLED not in long
    assert int(long["max_context_len"]) == 70
    none = paged_inputs(plan(BS, POOL, [PlanRow(1, 0, 3, (4,), sample=0), PlanRow(2, 0, 2, (5,), sample=0)]),
                        sampled=True)
    assert none[SAMPLED].tolist() == [4]  # the last real row, answered and dropped


def test_top1_reply_matches_the_top1_of_every_row():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 11)).astype(np.float32) * 30
    p = plan(BS, POOL, [PlanRow(1, 0, 3, (4,), sample=2), PlanRow(2, 0, 2, (5,), sample=2, want_logits=True)])
    ids, probs, rows = top1_reply(logits, p)
    want_ids, want_probs = top1(logits)
    assert ids.dtype == np.int64 and probs.dtype == np.float32
    assert ids.tolist() == want_ids.tolist() and probs.tolist() == want_probs.tolist()
    assert rows is not None and np.array_equal(rows, logits[2:])
    assert top1_reply(logits, dataclasses.replace(p, rows=(p.rows[0], dataclasses.replace(
        p.rows[1], want_logits=False))))[2] is None


def test_a_graph_without_a_head_matmul_is_refused_by_name():
    x = ops.parameter([-1, 4], ov.Type.f32, name="x")
    out = ops.relu(x)
    out.output(0).get_tensor().set_names({"logits"})
    with pytest.raises(LMHeadNotFoundError, match="no MatMul"):
        _logits_head(ov.Model([ops.result(out)], [x], "headless"))


def test_local_paged_path_delivers_outcomes_in_order_and_failures_as_data(paged):
    async def main():
        path = LocalPagedPath(paged(2), POOL, BUDGET)
        await path.async_start()
        good = plan(BS, POOL, [PlanRow(1, 0, 3, (5,))])
        too_big = StepPlan(BS, POOL + 1, (PlanRow(1, 0, 3, (5,)),))
        await path.async_submit(PagedStep(1, good, np.asarray([3, 4, 5])))
        await path.async_submit(PagedStep(2, too_big, np.asarray([3, 4, 5])))
        await path.async_submit(PagedStep(3, good, np.asarray([3, 4, 5])))
        outs = [await asyncio.wait_for(path.results.get(), 30) for _ in range(3)]
        await path.async_close()
        return path, outs

    path, outs = asyncio.run(main())
    assert [o.seq for o in outs] == [1, 2, 3]
    assert outs[0].error is None and len(outs[0].stage_ms) == 2 and all(ms > 0 for ms in outs[0].stage_ms)
    assert outs[1].error is not None and "PoolNotAllocatedError" in outs[1].error and str(POOL + 1) in outs[1].error
    assert outs[2].ids.tolist() == outs[0].ids.tolist()
    assert path.num_stages == 2 and path.block_size == BS
    assert set(path.stage_metrics()) == {'stage_compute_ms_per_step{stage="0"}', 'stage_compute_ms_per_step{stage="1"}'}


def test_a_bf16_pool_is_raw_words_that_openvino_writes_and_reads_as_bf16():
    """The raw-words pool on any CPU (the paged stage itself compiles a bf16 cache only on an
    avx512_bf16 CPU, below): numpy has no bf16, so the pool's array is uint16 words and the tensor
    bound to the infer request views the same memory as bf16. OpenVINO writes bf16 into it and
    reads it back as bf16 (bound as u16 or f16, the values read would be others), and a block
    moved word for word reads back the same values."""
    blocks, heads, rows, cols = shape = (8, 2, 4, 16)
    arr, tensor = pool_tensor(ov.Type.bf16, shape)
    assert arr.dtype == np.uint16 and arr.shape == shape and not arr.any()
    assert tensor.get_element_type() == ov.Type.bf16 and tensor.get_byte_size() == arr.nbytes == 2 * arr.size
    core = ov.Core()

    values = np.random.default_rng(5).normal(scale=40, size=shape).astype(np.float32)
    values[1, 0, 0, :4] = [65504.0, -0.0, 1e-3, 3.140625]  # rounded up to 2^16, a sign bit, small, exact
    x = ops.parameter(list(shape), ov.Type.f32, name="x")
    write = core.compile_model(ov.Model([ops.result(ops.convert(x, ov.Type.bf16))], [x], "write"), "CPU")
    writer = write.create_infer_request()
    writer.set_output_tensor(0, tensor)
    writer.infer({"x": values})
    decoded = (arr.astype(np.uint32) << 16).view(np.float32)  # bf16 words -> float32, exactly
    # OpenVINO wrote bf16 into the pool's own memory: 8 significant bits of every value
    assert np.allclose(decoded, values, rtol=2 ** -7, atol=0) and decoded[1, 0, 0, 0] == 65536.0

    arr[6] = arr[1]  # a block moved as the pool moves them: words copied, never read as numbers
    cache = ops.parameter([-1, heads, rows, cols], ov.Type.bf16, name="key_cache.0")
    which = ops.parameter([1], ov.Type.i64, name="block")
    read = ops.convert(ops.gather(cache, which, ops.constant(np.int64(0))), ov.Type.f32)
    reader = core.compile_model(ov.Model([ops.result(read)], [cache, which], "read"), "CPU").create_infer_request()
    reader.set_tensor("key_cache.0", tensor)
    for block in (1, 6):
        reader.infer({"block": np.array([block], np.int64)})
        assert np.array_equal(reader.get_output_tensor(0).data[0], decoded[1]), block


def test_the_pool_refuses_a_cache_type_it_cannot_hold_by_name():
    with pytest.raises(PagedStageError, match="u4 KV cache"):
        pool_tensor(ov.Type.u4, (2, 1, 32, 16))


@needs_cpu("avx512_bf16", "only there does the CPU plugin's PagedAttention compile a bf16 KV cache (on AVX2: "
                          "'expect kvcache type f32'); the raw-words pool is tested on every CPU by "
                          "test_a_bf16_pool_is_raw_words_that_openvino_writes_and_reads_as_bf16")
def test_a_bf16_cache_is_held_as_raw_words_and_serves_on_an_avx512_bf16_cpu(tiny_export):
    """A CPU with avx512_bf16 compiles an f16 cache request as bf16 (its inference precision); numpy
    has no bf16, so the pool holds the cache as 16-bit words bound under the cache's own type. The
    stage then serves a step, and its blocks move like any other's."""
    export = tiny_export("llama", 1)
    stage = PagedStage(export, 0, properties={"KV_CACHE_PRECISION": "bf16"})
    path = LocalPagedPath([stage], 8, BUDGET)
    assert {c.get_element_type().get_type_name() for c in stage._cache_inputs} == {"bf16"}
    assert all(arr.dtype == np.uint16 for arr in stage.caches)
    out = path.run(PagedStep(0, plan(BS, 8, [PlanRow(1, 0, 3, (5,))]), np.asarray([4, 5, 6])))
    assert out.ids.shape == (1,) and 0 < out.probs[0] <= 1
    assert any(arr[5].any() for arr in stage.caches)  # the step wrote its keys and values into block 5
    moved = stage.export_blocks([5])
    stage.import_blocks([6], moved)
    assert all(np.array_equal(arr[5], arr[6]) for arr in stage.caches)
