"""Qwen3-MoE through the stage builder: HF-identical greedy tokens split or not, the experts lowered
to the CPU's GatherMatmul kernel, experts quantised one by one, served by the paged runtime.

One tiny random ``qwen3_moe`` (8 experts, top-2, renormalised; layer 2 dense) exported through the
session's ``tiny_export``, so every test here shares the same few exports.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import openvino as ov
import pytest

from engine.generation.in_process import greedy_generate
from engine.shards.manifest import load_manifest
from engine.shards.stage import EXACT_PROPERTIES, LocalChain
from export.builder.families import UnsupportedModelError, model_shape
from tests.conftest import PROMPT_IDS

FAMILY = "qwen3_moe"
N_TOKENS = 16
MOE_LAYERS = (0, 1, 3)  # the tiny config's mlp_only_layers=[2]


@pytest.mark.parametrize("stages", [1, 2])
def test_greedy_equals_hf_torch(stages, tiny_export, hf_greedy):
    chain = LocalChain.load(tiny_export(FAMILY, stages), exact=True)
    result = greedy_generate(chain, PROMPT_IDS, N_TOKENS, ignore_eos=True)
    expected = hf_greedy(FAMILY, N_TOKENS)
    assert len(set(expected)) > 4, "the random model must not repeat one token, or identity proves nothing"
    assert result.tokens == expected


def _layer_types(compiled: ov.CompiledModel) -> Counter:
    return Counter(op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops())


def test_cpu_runtime_runs_the_experts_as_gather_matmuls(tiny_export):
    """Per MoE layer three GatherMatmuls (gate, up, down: only the routed experts' weights are
    read) and no expert left as a FullyConnected over all experts; attention fused as for Qwen3."""
    export = tiny_export(FAMILY, 1)
    manifest = load_manifest(export)
    core = ov.Core()
    compiled = core.compile_model(core.read_model(export / manifest.stages[0].xml), "CPU", dict(EXACT_PROPERTIES))
    counts = _layer_types(compiled)
    layers, dense = manifest.model.num_layers, manifest.model.num_layers - len(MOE_LAYERS)
    assert counts["GatherMatmul"] == 3 * len(MOE_LAYERS)
    # q, k, v, o per layer + gate, up, down per dense layer + the router per MoE layer + the head
    assert counts["FullyConnected"] == 4 * layers + 3 * dense + len(MOE_LAYERS) + 1
    assert counts["ScaledDotProductAttention"] == layers and counts["RoPE"] == 2 * layers
    assert counts["Tile"] == 0


def test_int4_experts_are_quantised_one_by_one(tiny_checkpoint):
    """The stacked [E, out, groups, g] constant holds, expert by expert, the codes and scales that
    expert's matrix quantised alone gives (no scale shared across experts)."""
    from export.weights.checkpoint import open_checkpoint
    from export.weights.rtn import quantize, scheme_for
    from export.weights.stage_weights import StageWeights, WeightMode

    names = [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(8)]
    source = open_checkpoint(tiny_checkpoint(FAMILY))
    with StageWeights(source, WeightMode("int4_sym", 16)) as w:
        out = w.stacked(names)
        assert list(out.get_partial_shape().to_shape()) == [8, 64, 32]
        nodes = {n.get_friendly_name(): n for n in ov.Model([out.get_node()], []).get_ordered_ops()}
        scale = nodes[f"{names[0]}/scale"].get_data()
        codes = nodes[names[0]]
        assert codes.get_element_type() == ov.Type.i4 and list(codes.get_output_shape(0)) == [8, 64, 2, 16]
        for e, name in enumerate(names):
            alone = quantize(source.read(name), scheme_for("int4_sym", 16))
            np.testing.assert_array_equal(scale[e], alone.scale)
        decompressed = ov.Core().compile_model(ov.Model([out.get_node()], []), "CPU")({})[0]
        for e, name in enumerate(names):
            alone = quantize(source.read(name), scheme_for("int4_sym", 16))
            np.testing.assert_allclose(decompressed[e], alone.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_int4_split_gives_the_unsplit_tokens(tiny_export):
    whole = greedy_generate(LocalChain.load(tiny_export(FAMILY, 1, "int4"), exact=True), PROMPT_IDS, N_TOKENS,
                            ignore_eos=True)
    split = greedy_generate(LocalChain.load(tiny_export(FAMILY, 2, "int4"), exact=True), PROMPT_IDS, N_TOKENS,
                            ignore_eos=True)
    assert split.tokens == whole.tokens
    # the manifest's expert bytes are the INT4 codes and f16 scales (groups of 16) of every expert
    hidden, inter = 64, 32
    per_expert = sum(rows * cols // 2 + rows * (cols // 16) * 2 for rows, cols in
                     ((inter, hidden), (inter, hidden), (hidden, inter)))  # gate, up, down
    for stage in load_manifest(tiny_export(FAMILY, 2, "int4")).stages:
        layers = [i for i in MOE_LAYERS if stage.first_layer <= i <= stage.last_layer]
        assert stage.moe is not None and stage.moe.expert_bytes == 8 * per_expert * len(layers)


def test_paged_runtime_serves_batched_streams_like_the_stateful_chain(tiny_export):
    """The paged conversion at load takes the MoE stages; streams batched into one step (their
    rows routed together through the experts) each get the tokens they get alone."""
    from engine.paged.stage import LocalPagedPath
    from engine.wire.step_plan import SCRATCH_BLOCKS
    from tests.shards.test_paged_stage import BUDGET, POOL, Stream, drive, prompts

    export = tiny_export(FAMILY, 2)
    stages = LocalPagedPath.load(export, SCRATCH_BLOCKS + 1, BUDGET, exact=True).stages
    path = LocalPagedPath(stages, POOL, BUDGET)
    ps = prompts(path.manifest.model.vocab_size)[:3]
    streams = [Stream(1, ps[0], len(ps[0])), Stream(2, ps[1], len(ps[1]), chunk=5), Stream(3, ps[2], len(ps[2]),
                                                                                          join=2)]
    got = drive(path, streams, n=8)
    chain = LocalChain.load(export, exact=True)
    for s, prompt in zip(streams, ps, strict=True):
        assert tuple(got[s.sid]) == greedy_generate(chain, prompt, 8, ignore_eos=True).tokens, f"stream {s.sid}"


BASE = {"model_type": FAMILY, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@pytest.mark.parametrize(("extra", "sparse"), [
    ({}, {0, 1, 2, 3, 4, 5}),
    ({"decoder_sparse_step": 2}, {1, 3, 5}),
    ({"decoder_sparse_step": 1, "mlp_only_layers": [0, 4]}, {1, 2, 3, 5}),
    ({"decoder_sparse_step": 3, "mlp_only_layers": [5]}, {2}),
])
def test_moe_layers_as_hf_decides_them(extra, sparse):
    shape = model_shape({**BASE, **extra})
    assert shape.moe is not None and shape.moe.layers == frozenset(sparse)
    assert [shape.is_moe_layer(i) for i in range(6)] == [i in sparse for i in range(6)]


def test_the_expert_count_may_be_named_num_local_experts():
    config = {k: v for k, v in BASE.items() if k != "num_experts"} | {"num_local_experts": 4, "norm_topk_prob": True}
    moe = model_shape(config).moe
    assert moe is not None and moe.experts == 4 and moe.per_token == 2 and moe.normalise


@pytest.mark.parametrize(("extra", "message"), [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_experts": 0}, "num_experts"),
    ({"shared_expert_intermediate_size": 64}, "shared expert"),
])
def test_a_moe_config_the_builder_cannot_build_is_refused_by_name(extra, message):
    with pytest.raises(UnsupportedModelError, match=message):
        model_shape({**BASE, **extra})


def test_the_npu_target_refuses_a_moe_model_by_name(tiny_checkpoint, tmp_path):
    from export.exporter import ExportError, ExportOptions, export_model

    options = ExportOptions(weights="fp32", target="npu", context=64)
    with pytest.raises(ExportError, match="mixture-of-experts.*--target stateful"):
        export_model(tiny_checkpoint(FAMILY), tmp_path / "out", stages=1, options=options)
    assert not (tmp_path / "out").exists()


def test_the_manifest_records_each_stages_expert_and_dense_bytes(tiny_export):
    """What placement prices a step by: E, k, and per stage the stacked experts' bytes (f32 here:
    E x (gate + up + down) x I x H x 4 per MoE layer) apart from the rest of its weight file."""
    export = tiny_export(FAMILY, 2)
    manifest = load_manifest(export)
    per_layer = 8 * 3 * 32 * manifest.model.hidden_size * 4
    for stage in manifest.stages:
        moe = stage.moe
        assert moe is not None and (moe.experts, moe.per_token) == (8, 2)
        layers = [i for i in MOE_LAYERS if stage.first_layer <= i <= stage.last_layer]
        assert moe.expert_bytes == per_layer * len(layers)
        weights = next(f.size for f in stage.files if f.path.endswith(".bin"))
        assert moe.expert_bytes + moe.dense_bytes == weights
