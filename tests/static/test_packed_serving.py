"""Static shards on the CPU device: identity with the unsplit model, sinks past the window,
packed vs unpacked agreement, exact slot isolation, admission limits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.shards.stage import LocalChain, StepInputs
from engine.static.packed_stage import PackedServer, StaticChain, static_generate
from engine.static.slot_scheduler import PromptTooLong
from engine.wire.plan_frame import IDLE, PlanFrame
from tests.conftest import FAMILIES, PROMPT_IDS
from tests.support.npu_helpers import npu_export

# Each test exports (NPU target) and decodes whole static graphs on the CPU: minutes together;
# the fast lane covers the static path with test_packing.py and test_packed_ring.py.
pytestmark = pytest.mark.slow

N_TOKENS = 32
# (prompt length, new tokens): more requests than slots, different lengths, early finishers;
# prompt + new tokens stay within a 32-position region, where packing must change nothing.
REQUESTS = ((17, 15), (5, 27), (9, 4), (12, 20), (3, 29), (14, 8), (1, 6))


def _prompt(i: int, n: int) -> list[int]:
    ids = PROMPT_IDS * 3
    return list(ids[i : i + n])


# The builder-only families (q/k norms, fused projections) at two stages only: the graph code
# they add is per layer, and the four older families cover the 1-stage graphs.
IDENTITY = [(f, s) for f in FAMILIES for s in (1, 2)] + [("qwen3", 2), ("phi3", 2)]


@pytest.mark.parametrize("family, stages", IDENTITY)
def test_static_greedy_equals_hf_torch_inside_the_window(family, stages, tmp_path_factory, tiny_checkpoint,
                                                         hf_greedy):
    export = npu_export(tmp_path_factory, tiny_checkpoint(family), stages=stages, context=64, prefill_chunk=8)
    expected = list(hf_greedy(family, N_TOKENS))
    assert len(set(expected)) > 4, "the random model must not repeat one token, or identity proves nothing"
    chunked = StaticChain.load(export, exact=True)
    assert chunked.row_options == (1, 8)
    assert static_generate(chunked, PROMPT_IDS, N_TOKENS, ignore_eos=True) == expected
    token_by_token = StaticChain.load(export, exact=True, graphs=["decode"])
    assert static_generate(token_by_token, PROMPT_IDS, N_TOKENS, ignore_eos=True) == expected


def test_int4_static_shards_give_the_stateful_int4_tokens(tmp_path_factory, tiny_checkpoint, tiny_export):
    from engine.generation.in_process import greedy_generate

    stateful = greedy_generate(LocalChain.load(tiny_export("llama", 2, "int4"), exact=True), PROMPT_IDS,
                               N_TOKENS, ignore_eos=True)
    static = StaticChain.load(npu_export(tmp_path_factory, tiny_checkpoint("llama"), stages=2, context=64,
                                         weights="int4"), exact=True)
    assert static_generate(static, PROMPT_IDS, N_TOKENS, ignore_eos=True) == list(stateful.tokens)


def _streaming_reference(chain: LocalChain, prompt, n_new: int, window: int, sinks: int) -> list[int]:
    """Greedy decode on the stateful shards where token n sees only the sinks, the last
    window - sinks tokens and itself, at their true positions: what the static ring must do."""
    streams = chain.new_streams()
    p = len(prompt)
    ids = np.array([prompt], dtype=np.int64)
    logits = chain.forward(streams, StepInputs(ids, np.ones((1, p), np.int64), np.arange(p)[None], 1))
    tokens = [int(np.argmax(logits[0, -1]))]
    for n in range(p, p + n_new - 1):
        past = np.arange(n)
        visible = (past < sinks) | (past >= n - (window - sinks)) if n > window else np.ones(n, bool)
        mask = np.concatenate([visible, [True]]).astype(np.int64)[None]
        logits = chain.forward(streams, StepInputs(np.array([[tokens[-1]]]), mask, np.array([[n]]), 1))
        tokens.append(int(np.argmax(logits[0, -1])))
    return tokens


@pytest.mark.parametrize("sinks", [4, 0])
def test_past_the_window_the_ring_slides_behind_pinned_sinks_at_true_positions(sinks, tmp_path_factory,
                                                                               tiny_checkpoint, tiny_export):
    context, n_new = 24, 64  # a 23-position ring, wrapped almost three times
    export = npu_export(tmp_path_factory, tiny_checkpoint("llama"), stages=2, context=context, prefill_chunk=4)
    chain = StaticChain.load(export, exact=True, sinks=sinks)
    got = static_generate(chain, PROMPT_IDS, n_new, ignore_eos=True)
    stateful = LocalChain.load(tiny_export("llama", 2), exact=True)
    assert got[:context - len(PROMPT_IDS)] == list(static_generate(
        StaticChain.load(npu_export(tmp_path_factory, tiny_checkpoint("llama"), stages=2, context=64,
                                    prefill_chunk=8), exact=True), PROMPT_IDS, n_new, ignore_eos=True))[
        :context - len(PROMPT_IDS)], "inside the window nothing may change"
    assert got == _streaming_reference(stateful, PROMPT_IDS, n_new, context - 1, sinks)
    assert len(set(got[-20:])) > 2, "past the window the output must not collapse into one token"
    assert got == static_generate(chain, PROMPT_IDS, n_new, ignore_eos=True), "stable from run to run"


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_serving_gives_each_request_its_unpacked_tokens(family, tmp_path_factory, tiny_checkpoint):
    ckpt = tiny_checkpoint(family)
    packed = StaticChain.load(npu_export(tmp_path_factory, ckpt, stages=2, context=132, slots=4), exact=True)
    alone = StaticChain.load(npu_export(tmp_path_factory, ckpt, stages=2, context=64, prefill_chunk=8), exact=True,
                             graphs=["decode"])
    server = PackedServer(packed)
    ids = [server.submit(_prompt(i, n), new, ignore_eos=True) for i, (n, new) in enumerate(REQUESTS)]
    done = server.run()
    for i, ((n, new), rid) in enumerate(zip(REQUESTS, ids, strict=True)):
        assert done[rid].tokens == static_generate(alone, _prompt(i, n), new, ignore_eos=True), f"request {i}"
    # Early finishers' regions went to later requests while others were still running, and
    # packing needed far fewer inferences than serving one request after another.
    first_four_last = max(done[r].finished for r in ids[:4])
    assert done[ids[4]].first_token < first_four_last and done[ids[6]].first_token < first_four_last
    assert server.steps < 0.5 * sum(n + new - 1 for n, new in REQUESTS)


def test_a_prompt_that_cannot_fit_its_region_is_refused(tmp_path_factory, tiny_checkpoint):
    server = PackedServer(StaticChain.load(npu_export(tmp_path_factory, tiny_checkpoint("llama"), stages=2,
                                                      context=132, slots=4)))
    with pytest.raises(PromptTooLong, match="33 tokens but a slot holds 32"):
        server.submit(list(range(1, 34)), 4)
    assert not server.busy
    server.submit(list(range(1, 33)), 40, ignore_eos=True)  # fits; the generation slides in the region
    assert len(server.run()[1].tokens) == 40


def _set_slot(chain: StaticChain, k: int, count: int, rng: np.random.Generator | None,
              saved: list[dict] | None = None) -> None:
    """Put slot k at ``count`` tokens on every stage, its region filled with random (or saved) K/V."""
    geo = chain.geometry
    cols = np.arange(k * geo.region, (k + 1) * geo.region)
    for j, st in enumerate(chain.stages):
        slots = list(st.slots)
        slots[k] = replace(slots[k], count=count)
        st.slots = tuple(slots)
        if saved is not None:
            for name, arr in st.ring.arrays.items():
                arr[0][:, cols, :] = saved[j][name]
        else:
            st.ring.fill(rng, cols)


@pytest.mark.parametrize("own_rows", [1, 2])
def test_isolation_is_exact_other_slots_cannot_move_a_slot_by_one_bit(own_rows, tmp_path_factory, tiny_checkpoint):
    chain = StaticChain.load(npu_export(tmp_path_factory, tiny_checkpoint("llama"), stages=2, context=132,
                                        slots=4), exact=True)
    geo = chain.geometry
    fixed = np.random.default_rng(7)
    _set_slot(chain, 0, 10, fixed)
    cols = np.arange(0, geo.region)
    saved = [{n: a[0][:, cols, :].copy() for n, a in st.ring.arrays.items()} for st in chain.stages]
    own = [(0, 10 + j, 0) for j in range(own_rows)]
    own_tokens = [101, 202][:own_rows]
    outputs = []
    for trial in range(6):
        rng = np.random.default_rng(trial)
        _set_slot(chain, 0, 10, None, saved)
        rows = list(own)
        for k in (1, 2, 3):
            count = int(rng.integers(0, 3 * geo.region))  # some regions wrapped
            _set_slot(chain, k, count, rng)
            n = int(rng.integers(0, geo.slots - len(rows) + 1))
            rows += [(k, count + j, 0) for j in range(n)]
        frame = PlanFrame.of(rows, geo.slots)
        tokens = np.where(frame.slot == IDLE, 0, rng.integers(0, 500, geo.slots)).astype(np.int64)
        tokens[:own_rows] = own_tokens
        outputs.append(chain.step(frame, tokens)[0, :own_rows].copy())
    for out in outputs[1:]:
        assert np.array_equal(out, outputs[0]), f"max |diff| {np.abs(out - outputs[0]).max()}"
    # The check has teeth: the slot's own input does move its output.
    _set_slot(chain, 0, 10, None, saved)
    frame = PlanFrame.of(own, geo.slots)
    tokens = np.zeros(geo.slots, np.int64)
    tokens[:own_rows] = [303, 404][:own_rows]
    changed = chain.step(frame, tokens)[0, :own_rows]
    assert np.abs(changed - outputs[0]).max() > 1e-2


def test_default_model_packed_agrees_with_unpacked(default_checkpoint, tmp_path_factory):
    from engine.generation.tokenizer import ChatTokenizer

    tok = ChatTokenizer(default_checkpoint)
    questions = ["What is the capital of France?", "Name three primary colours.", "What is 12 times 12?"]
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    packed = StaticChain.load(npu_export(tmp_path_factory, default_checkpoint, stages=2, context=256, slots=4,
                                         weights="fp16"), exact=True)  # INT4 compression: tested on the tiny model
    alone = StaticChain.load(npu_export(tmp_path_factory, default_checkpoint, stages=2, context=256,
                                        prefill_chunk=16, weights="fp16"), exact=True)
    server = PackedServer(packed)
    ids = [server.submit(p, 16, ignore_eos=True) for p in prompts]
    done = server.run()
    expected = [static_generate(alone, p, 16, ignore_eos=True) for p in prompts]
    assert [done[r].tokens for r in ids] == expected
    assert "Paris" in tok.decode(expected[0])
