"""Split shards reproduce the unsplit model: HF torch greedy == 1/2/3-stage OpenVINO greedy."""

from __future__ import annotations

import pytest

from engine.generation.in_process import greedy_generate
from engine.shards.manifest import load_manifest
from engine.shards.stage import LocalChain, Stage
from tests.conftest import FAMILIES, PROMPT_IDS

N_TOKENS = 32


@pytest.mark.parametrize("family", FAMILIES)
# Three stages (a third graph to export and compile per family) run in the slow lane.
@pytest.mark.parametrize("stages", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_chained_greedy_equals_hf_torch(family, stages, tiny_export, hf_greedy):
    chain = LocalChain.load(tiny_export(family, stages), exact=True)
    result = greedy_generate(chain, PROMPT_IDS, N_TOKENS, ignore_eos=True)
    expected = hf_greedy(family, N_TOKENS)
    assert len(set(expected)) > 4, "the random model must not repeat one token, or identity proves nothing"
    assert result.tokens == expected


@pytest.mark.parametrize("stages", [1, 2])
def test_every_layer_fuses_attention_with_the_cache(stages, tiny_export):
    export = tiny_export("llama", stages)
    manifest = load_manifest(export)
    for spec in manifest.stages:
        stage = Stage(export, spec.index, manifest=manifest, exact=True)
        assert stage.fused_attention_count() == spec.num_layers


def test_without_beam_idx_attention_is_not_fused(tiny_export):
    export = tiny_export("llama", 1, beam_idx=False)
    manifest = load_manifest(export)
    assert "beam_idx" not in manifest.stages[0].input_names
    assert Stage(export, 0, manifest=manifest, exact=True).fused_attention_count() == 0
    # Same weights, same answer: the injection changes speed, never tokens.
    with_beam = greedy_generate(LocalChain.load(tiny_export("llama", 1), exact=True), PROMPT_IDS, 16, ignore_eos=True)
    without = greedy_generate(LocalChain.load(export, exact=True), PROMPT_IDS, 16, ignore_eos=True)
    assert with_beam.tokens == without.tokens


@pytest.mark.slow
def test_int4_split_gives_the_same_tokens_as_int4_unsplit(tiny_export):
    whole = greedy_generate(LocalChain.load(tiny_export("llama", 1, "int4"), exact=True), PROMPT_IDS, N_TOKENS,
                            ignore_eos=True)
    for stages in (2, 3):
        split = greedy_generate(LocalChain.load(tiny_export("llama", stages, "int4"), exact=True), PROMPT_IDS,
                                N_TOKENS, ignore_eos=True)
        assert split.tokens == whole.tokens


def test_int4_export_is_compressed_and_records_its_format(tiny_export):
    fp32 = load_manifest(tiny_export("llama", 2))
    int4 = load_manifest(tiny_export("llama", 2, "int4"))
    assert int4.weights.format == "int4" and int4.weights.group_size == 16
    size = lambda m: sum(f.size for s in m.stages for f in s.files)  # noqa: E731
    assert size(int4) < 0.5 * size(fp32)


def test_chunked_prefill_matches_one_shot_prefill(tiny_export):
    chain = LocalChain.load(tiny_export("llama", 2), exact=True)
    whole = greedy_generate(chain, PROMPT_IDS, 16, ignore_eos=True)
    chunked = greedy_generate(chain, PROMPT_IDS, 16, ignore_eos=True, prefill_chunk=5)
    assert chunked.tokens == whole.tokens
