"""`python -m tests.benchmarks gguf-keep` on a tiny mixed-type GGUF (Q4_0/Q4_1/Q8_0/F16): four
real 1-stage exports, exact-settings greedy runs and paired speed rounds, minimal sizes."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks import gguf_keep as bench
from tests.support import llama_gguf

pytest.importorskip("gguf")

TOKENS = 6


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-keep")
    # FFN 128 so that both INT4 group sizes (32, 64) divide every input dimension.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama_gguf, "FFN", 128)
        llama_gguf.write_llama_gguf(root / "tiny.gguf", llama_gguf.MIXED, seed=4)
    prompts = [[5, 17, 40, 3], [9, 9, 100, 250, 7], [300, 1]]
    out = bench.measure(root / "tiny.gguf", "tiny", root / "exports", prompts, tokens=TOKENS, runs=2, warmups=1,
                        threads=1, exact_threads=1, log=lambda _m: None)
    return {"command": bench.COMMAND_LINE, **out}, prompts, root


def test_agreement_comes_from_the_runs(result):
    r, prompts, root = result
    gen = r["agreement"]["tokens"]
    assert set(gen) == {v.name for v in bench.VARIANTS}
    assert all(len(t) == TOKENS for runs in gen.values() for t in runs)
    assert all(len(v) == len(prompts) for v in gen.values())
    for name, v in r["agreement"]["variants"].items():
        assert v["first_divergence"] == [bench.first_divergence(t, ref) for t, ref in
                                         zip(gen[name], gen[bench.REFERENCE], strict=True)]
        assert v["prompts_equal"] == sum(f == TOKENS for f in v["first_divergence"])
    assert bench.REFERENCE not in r["agreement"]["variants"]
    # re-running one variant's exact greedy gives the recorded tokens (deterministic, not made up)
    again = bench.exact_tokens(root / "exports" / r["exports"]["keep"]["dir"], prompts, TOKENS, 1)
    assert again == gen["keep"]


def test_speed_rounds_are_paired_and_rotated(result):
    r, _, _ = result
    s = r["speed"]
    assert set(s["variants"]) == set(bench.SPEED_VARIANTS)
    assert all(len(v["decode_tok_per_s"]) == 2 and v["median_decode_tok_per_s"] > 0 for v in s["variants"].values())
    assert [o[0] for o in s["round_orders"]] == list(bench.SPEED_VARIANTS)
    assert set(s["ratios"]) == {"keep/g32", "keep/g64"} and all(v["decode"] > 0 for v in s["ratios"].values())


def test_exports_differ_as_their_modes_say(result):
    r, _, root = result
    manifests = {n: json.loads((root / "exports" / e["dir"] / "manifest.json").read_text())
                 for n, e in r["exports"].items()}
    assert len({json.dumps(m["stages"]) for m in manifests.values()}) == 4  # four distinct weight files
    assert r["exports"]["keep"]["mb"] < r["exports"]["fp32"]["mb"]


def test_render_and_first_divergence(result, tmp_path):
    r, _, _ = result
    text = bench.render(r, tmp_path / "x.json")
    assert "first divergence per prompt" in text and "keep/g32" in text
    assert bench.first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert bench.first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert bench.first_divergence([4], [1]) == 0
