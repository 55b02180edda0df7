"""Gemma 4 (text) through the stage builder, served by the paged runtime: HF-identical greedy tokens
at 1, 2 and 3 stages, prompts longer than the sliding window, logits soft-capped as HF's; the MoE
variant (``gemma4_moe``) at 1 and 2 stages with its experts on the CPU's GatherMatmul.

One tiny random ``gemma4_text`` (tests/support/tiny_models.py: 6 layers, sliding window 8, full
layers with their own head_dim, keys = values and proportional rope, per-layer embeddings, the
last 3 layers reusing the K/V of layers 1 and 2) exported through the session's ``tiny_export``.
The 2- and 3-stage cuts put a K/V-reusing layer in a later stage than its producer (3 stages: the
producer of layer 5's K/V two stages back), so the carried PLE and K/V columns are exercised.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import pytest

from engine.generation.in_process import greedy_generate
from engine.paged.stage import LocalPagedPath
from engine.shards.manifest import load_manifest
from engine.shards.stage import EXACT_PROPERTIES, LocalChain
from engine.shards.tensor_names import ATTENTION_MASK, BEAM_IDX, INPUT_IDS, LOGITS_LAST, POSITION_IDS
from export.builder.families import UnsupportedModelError, model_shape
from export.builder.gemma4_shape import carried
from tests.conftest import PROMPT_IDS
from tests.shards.test_paged_stage import BUDGET, POOL, Stream, drive, prompts

FAMILY = "gemma4"
N_TOKENS = 16  # PROMPT_IDS (17) + 16 = 33 positions, four times the window of 8


@pytest.fixture(scope="module")
def paged_path(tiny_export):
    built: dict[int, LocalPagedPath] = {}

    def get(stages: int) -> LocalPagedPath:
        if stages not in built:
            built[stages] = LocalPagedPath.load(tiny_export(FAMILY, stages), POOL, BUDGET, exact=True)
        return built[stages]

    return get


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_paged_greedy_equals_hf_torch(stages, paged_path, hf_greedy):
    got = drive(paged_path(stages), [Stream(1, list(PROMPT_IDS), len(PROMPT_IDS))], n=N_TOKENS)
    expected = hf_greedy(FAMILY, N_TOKENS)
    assert len(set(expected)) > 4, "the random model must not repeat one token, or identity proves nothing"
    assert tuple(got[1]) == expected


def test_a_ring_of_paged_workers_on_loopback_answers_like_the_local_path(tiny_export):
    """Three paged workers over real sockets: the carried PLE and K/V columns travel in the Step
    frames (wider than the hidden size) and every step's answer is the in-process path's."""
    from tests.support.asyncutil import run
    from tests.worker.test_paged_worker import next_reply, paged_ring, recorded_steps, step_frame

    stages = LocalPagedPath.load(tiny_export(FAMILY, 3), POOL, BUDGET, exact=True).stages
    recorded = recorded_steps(stages)

    async def main():
        async with paged_ring(stages) as (dial, replies, _):
            conn = await dial()
            got = []
            for step, _ in recorded:
                await conn.async_send(step_frame(7, step))
                got.append(await next_reply(replies))
            return got

    for (step, want), reply in zip(recorded, run(main(), 120), strict=True):
        assert reply.ids.tolist() == want.ids.tolist(), f"step {step.seq}"


def test_stateful_chain_greedy_equals_hf_torch(tiny_export, hf_greedy):
    chain = LocalChain.load(tiny_export(FAMILY, 2), exact=True)
    assert greedy_generate(chain, PROMPT_IDS, N_TOKENS, ignore_eos=True).tokens == hf_greedy(FAMILY, N_TOKENS)


def test_batched_chunked_streams_past_the_window_get_their_own_tokens(tiny_export, paged_path):
    """Streams batched into one step, one prefilled in chunks of 5 across the window of 8 and one of
    40 tokens, each get the tokens the stateful chain gives it alone."""
    path = paged_path(2)
    ps = prompts(path.manifest.model.vocab_size)
    streams = [Stream(1, ps[1], len(ps[1]), chunk=5), Stream(2, ps[2], len(ps[2]), join=2),
               Stream(3, ps[3], len(ps[3]), join=1, chunk=5)]
    got = drive(path, streams, n=8)
    chain = LocalChain.load(tiny_export(FAMILY, 1), exact=True)
    for s in streams:
        prompt = s.seq[:s.prompt_len]
        assert tuple(got[s.sid]) == greedy_generate(chain, prompt, 8, ignore_eos=True).tokens, f"stream {s.sid}"


def test_logits_are_soft_capped_as_hf(tiny_export, tiny_checkpoint):
    """Every prompt position's logits equal HF's (soft cap 2.0: they stay inside (-2, 2))."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(FAMILY), dtype=torch.float32)
    with torch.no_grad():
        expected = model(torch.tensor([PROMPT_IDS])).logits[0].numpy()
    export = tiny_export(FAMILY, 1)
    core = ov.Core()
    compiled = core.compile_model(core.read_model(export / load_manifest(export).stages[0].xml), "CPU",
                                  dict(EXACT_PROPERTIES))
    n = len(PROMPT_IDS)
    got = compiled({INPUT_IDS: np.array([PROMPT_IDS], np.int64), ATTENTION_MASK: np.ones((1, n), np.int64),
                    POSITION_IDS: np.arange(n, dtype=np.int64)[None], LOGITS_LAST: np.array(0, np.int64),
                    BEAM_IDX: np.zeros(1, np.int32)})[0][0]
    assert np.abs(expected).max() < 2.0 and np.abs(expected).max() > 1.0
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-4)


def test_the_activation_carries_ple_and_shared_kv_across_each_cut(tiny_export, tiny_checkpoint):
    """Stage inputs are [B, S, hidden + carried]: 2 stages (cut before layer 3) carry the PLE of
    layers 3-5 and the new K/V of layers 1 and 2; 3 stages carry layer 1's K/V through stage 1."""
    from export.exporter import read_config

    shape = model_shape(read_config(tiny_checkpoint(FAMILY)))
    assert shape.gemma4 is not None and shape.gemma4.kv_source == (0, 1, 2, 2, 2, 1)
    two = load_manifest(tiny_export(FAMILY, 2)).stages[1]
    assert [(c.kind, c.layer) for c in carried(shape.gemma4, 2)] == [
        ("ple", 3), ("ple", 4), ("ple", 5), ("key", 1), ("value", 1), ("key", 2), ("value", 2)]
    assert two.activation_input_width == 64 + 3 * 8 + 2 * 32 + 2 * 32
    three = load_manifest(tiny_export(FAMILY, 3))
    assert [(c.kind, c.layer) for c in carried(shape.gemma4, 3)] == [
        ("ple", 4), ("ple", 5), ("key", 1), ("value", 1), ("key", 2), ("value", 2)]
    assert three.stages[1].activation_input_width == 64 + 4 * 8 + 2 * 32  # layer 2's K/V are not made yet
    assert three.stages[2].activation_input_width == 64 + 2 * 8 + 2 * 32 + 2 * 32
    assert three.activation_width == three.stages[2].activation_input_width


MOE = "gemma4_moe"  # 4 layers, 4 experts, top-2, beside every layer's dense MLP


@pytest.mark.parametrize("stages", [1, 2])
def test_moe_paged_greedy_equals_hf_torch(stages, tiny_export, hf_greedy):
    path = LocalPagedPath.load(tiny_export(MOE, stages), POOL, BUDGET, exact=True)
    got = drive(path, [Stream(1, list(PROMPT_IDS), len(PROMPT_IDS))], n=N_TOKENS)
    expected = hf_greedy(MOE, N_TOKENS)
    assert len(set(expected)) > 4, "the random model must not repeat one token, or identity proves nothing"
    assert tuple(got[1]) == expected


def test_moe_experts_run_as_gather_matmuls_and_the_manifest_knows_them(tiny_export):
    """Per layer three GatherMatmuls (gate, up, down: only the routed experts' weights are read);
    the manifest's MoE entry (placement's memory and streamed bytes) counts 4 experts, 2 per token."""
    from collections import Counter

    export = tiny_export(MOE, 1)
    manifest = load_manifest(export)
    core = ov.Core()
    compiled = core.compile_model(core.read_model(export / manifest.stages[0].xml), "CPU", dict(EXACT_PROPERTIES))
    counts = Counter(op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops())
    assert counts["GatherMatmul"] == 3 * manifest.model.num_layers
    moe = manifest.stages[0].moe
    assert moe is not None and (moe.experts, moe.per_token) == (4, 2)
    assert moe.expert_bytes == 4 * 4 * (2 * 32 * 64 + 64 * 32) * manifest.model.num_layers  # f32 gate, up, down


def test_expert_views_are_the_stacked_experts_one_by_one(tiny_checkpoint):
    from export.weights.checkpoint import open_checkpoint
    from export.weights.expert_views import ExpertViews

    source = open_checkpoint(tiny_checkpoint(MOE))
    stacked = source.read("model.layers.1.experts.gate_up_proj")  # [E, 2 I, H]
    down = source.read("model.layers.1.experts.down_proj")  # [E, H, I]
    views = ExpertViews(source)
    assert "model.layers.1.experts.gate_up_proj" not in views.names()
    assert views.shape("model.layers.1.experts.3.up_proj") == (32, 64)
    np.testing.assert_array_equal(views.read("model.layers.1.experts.3.gate_proj"), stacked[3, :32])
    np.testing.assert_array_equal(views.read_rows("model.layers.1.experts.3.up_proj", 4, 9), stacked[3, 36:41])
    np.testing.assert_array_equal(views.read("model.layers.1.experts.0.down_proj"), down[0])


BASE = {"model_type": "gemma4_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}}


@pytest.mark.parametrize(("extra", "message"), [
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5, "moe_intermediate_size": 8}, "top_k_experts"),
    ({"use_bidirectional_attention": "all"}, "bidirectional"),
    ({"hidden_activation": "silu"}, "gelu_pytorch_tanh"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn"}, "full_attention": {}}}, "yarn"),
    ({"num_kv_shared_layers": 2}, "no layer computing"),
])
def test_a_gemma4_config_the_builder_cannot_build_is_refused_by_name(extra, message):
    with pytest.raises(UnsupportedModelError, match=message):
        model_shape({**BASE, **extra})


def test_a_multimodal_gemma4_checkpoint_is_refused_naming_the_text_model():
    with pytest.raises(UnsupportedModelError, match="multimodal Gemma 4.*gemma4_text"):
        model_shape({"model_type": "gemma4", "text_config": BASE})


def test_the_npu_target_refuses_gemma4_by_name(tiny_checkpoint, tmp_path):
    from export.exporter import ExportError, ExportOptions, export_model

    options = ExportOptions(weights="fp32", target="npu", context=64)
    with pytest.raises(ExportError, match="NPU target does not build Gemma 4.*--target stateful"):
        export_model(tiny_checkpoint(FAMILY), tmp_path / "out", stages=1, options=options)
    assert not (tmp_path / "out").exists()
