"""`python -m tests.benchmarks parity` on the tiny model: every variant runs, the JSON and the
Markdown section have their shape, exports are measured from outside. No speed assertions."""

from __future__ import annotations

import argparse
import json
import random

import openvino  # noqa: F401  (its first import starts a telemetry thread: not this test's leak)
import pytest

from tests.benchmarks import parity as bench_parity
from tests.benchmarks.kit import Run


def _args(tmp_path, checkpoint, **over) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_parity.configure(p)
    argv = ["--model", str(checkpoint), "--reference", "ours-ir", "--weights", "fp16", "--stages", "1,2",
            "--threads", "1", "--runs", "1", "--warmups", "1", "--tokens", "3",
            "--json", str(tmp_path / "parity.json"), "--doc", str(tmp_path / "BENCH.md"),
            "--export-root", str(tmp_path / "exports")]
    for k, v in over.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


def test_parity_runs_every_variant_and_records_json_and_table(tmp_path, tiny_checkpoint):
    doc = tmp_path / "BENCH.md"
    doc.write_text("# Benchmarks\n\n<!-- other:start -->\nkept\n<!-- other:end -->\n")
    args = _args(tmp_path, tiny_checkpoint("llama"))
    assert bench_parity.run(args) == 0

    result = json.loads((tmp_path / "parity.json").read_text())
    t = result["threads"]["1"]
    assert set(t["variants"]) == {"fp16 sdpa", "fp16 pa", "fp16 1", "fp16 2", "fp16 paged-1", "fp16 paged-2"}
    for v in t["variants"].values():  # one timed round each, a real measurement
        assert len(v["decode_tok_per_s"]) == 1 and v["decode_tok_per_s"][0] > 0
        assert len(v["ttft_ms"]) == 1 and v["ttft_ms"][0] > 0
    r = t["ratios"]["fp16"]
    ours = {"1", "2", "paged-1", "paged-2"}
    assert set(r["decode_vs_sdpa"]) == set(r["ttft_vs_sdpa"]) == set(r["decode_vs_pa"]) == ours
    assert all(x > 0 for x in r["decode_vs_sdpa"].values())
    assert set(r["paged_vs_stateful_decode"]) == set(r["paged_vs_stateful_ttft"]) == {"1", "2"}
    assert all(x > 0 for x in r["paged_vs_stateful_decode"].values())
    assert set(r["rounds_tokens_equal"]) == {"sdpa", "pa"} | ours
    assert r["rounds_tokens_equal"]["1"] == 1  # our first export against itself
    # two rounds (warm-up + timed), the second in the first's order rotated by one
    first, second = t["round_orders"]
    assert second == first[1:] + first[:1] and sorted(first) == sorted(t["variants"])
    nodes = t["runtime_nodes"]["fp16"]
    assert nodes["ours_1_stage"].get("ScaledDotProductAttention", 0) >= 1 and nodes["reference"]

    assert result["prompt_tokens"] > result["nonce_tokens"] == 8
    assert len(result["load_before"]) == len(result["load_after"]) == 3
    assert result["runtimes"] == ["stateful", "paged"] and result["paged_pool_mb"] == 64.0
    assert "not exposed" in result["reference_cache_hits"]
    for name in ("fp16 1", "fp16 2"):
        m = result["export_memory"][name]
        assert m["vmhwm_mb"] > m["after_imports_mb"] > 0
        assert m["largest_stage_mb"] > 0 and m["net_peak_mb"] > 0

    text = doc.read_text()
    assert "<!-- other:start -->\nkept\n<!-- other:end -->" in text  # another section untouched
    section = text.split("<!-- parity:start -->", 1)[1].split("<!-- parity:end -->", 1)[0]
    assert "python -m tests.benchmarks parity --weights fp16 --stages 1,2 --threads 1" in section
    for row in ("| fp16 sdpa |", "| fp16 pa |", "| fp16 1 |", "| fp16 2 |", "| fp16 paged-1 |", "| fp16 paged-2 |",
                "| fp16 | sdpa |", "| fp16 | pa |"):
        assert row in section
    assert "Paged against stateful on the same export" in section
    assert "retired from serving in issue 27: these rows measure the export" in section
    assert "What changed" in section and "Export peak" in section


def test_nonce_prompts_have_one_length_and_differ():
    class Digits:
        def encode(self, text: str) -> list[int]:
            return [100 + int(text)]

    rng = random.Random(1)
    chat = [1, 2, 3]
    prompts = [bench_parity.nonce_prompt(Digits(), chat, rng, 8) for _ in range(20)]
    assert {len(p) for p in prompts} == {11}
    assert all(p[8:] == chat for p in prompts)
    assert len({tuple(p[:8]) for p in prompts}) == 20


def test_nonce_refuses_a_tokenizer_that_merges_digits():
    class Merging:
        def encode(self, text: str) -> list[int]:
            return [1, 2]

    with pytest.raises(RuntimeError, match="one token per digit"):
        bench_parity.nonce_prompt(Merging(), [1], random.Random(0), 4)


def test_paired_ratio_is_the_median_of_per_round_ratios():
    def runs(*rates):
        return [Run((), 0.1, r) for r in rates]

    got = bench_parity.paired({"a": runs(10, 20, 90), "b": runs(10, 10, 30)}, "a", "b", "decode_tok_per_s")
    assert got == 2.0  # per round 1, 2, 3 -> 2; the ratio of medians would be 20/10 = 2 too, so:
    got = bench_parity.paired({"a": runs(10, 40, 30), "b": runs(20, 10, 30)}, "a", "b", "decode_tok_per_s")
    assert got == 1.0  # per round 0.5, 4, 1 -> 1; medians 30/20 would say 1.5


def test_paged_variants_are_compared_with_their_stateful_export_and_get_its_targets():
    def runs(rate, ttft=0.2, tokens=(1, 2)):
        return [Run(tokens, ttft, rate), Run(tokens, ttft, rate * 2)]

    got = bench_parity.summarise_threads(
        {"int4 sdpa": runs(20), "int4 pa": runs(25), "int4 1": runs(18), "int4 2": runs(16, tokens=(1, 3)),
         "int4 paged-1": runs(36, 0.1), "int4 paged-2": runs(32, 0.4)}, ["int4"], [1, 2], has_ir=False)
    r = got["ratios"]["int4"]
    assert r["first"] == "1"
    assert r["paged_vs_stateful_decode"] == {"1": 2.0, "2": 2.0}
    assert r["paged_vs_stateful_ttft"] == {"1": 0.5, "2": 2.0}
    assert list(r["decode_vs_sdpa"]) == ["1", "2", "paged-1", "paged-2"]
    assert r["decode_vs_sdpa"]["paged-1"] == 1.8
    assert r["rounds_tokens_equal"] == {"sdpa": 2, "pa": 2, "1": 2, "2": 0, "paged-1": 2, "paged-2": 2}
    assert [bench_parity._stages_of(k) for k in ("1", "paged-3", "sdpa", "ir")] == [1, 3, None, None]
    # only the paged runtime: no pairing, its first variant is the tokens' reference
    alone = bench_parity.summarise_threads({"int4 sdpa": runs(20), "int4 pa": runs(25), "int4 paged-1": runs(30)},
                                           ["int4"], [1], has_ir=False)["ratios"]["int4"]
    assert alone["first"] == "paged-1" and alone["paged_vs_stateful_decode"] == {}
