"""`python -m tests.benchmarks batching` (issue 14, Deliver 6): its figures from users' token times,
its medians and per-round ratios, its prompts, its section, and toy runs on the tiny model (2 users,
4 tokens) whose JSON must have its shape and sane numbers. No speed is asserted."""

from __future__ import annotations

import argparse
import json
import random

import openvino  # noqa: F401  (its first import starts a telemetry thread: not this test's leak)
import pytest

from tests.benchmarks import batching as bench
from tests.benchmarks.batching_variants import UserRun


def _args(tmp_path, **over) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.configure(p)
    argv = ["--json", str(tmp_path / "batching.json"), "--doc", str(tmp_path / "BENCH.md")]
    for k, v in over.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return p.parse_args(argv)


def test_rows_put_each_long_row_after_its_short_one_and_orders_rotate():
    assert bench.cells([1, 2, 8], [1, 8, 16]) == [(1, "short"), (1, "long"), (2, "short"), (8, "short"),
                                                 (8, "long")]
    assert bench.cells([2], []) == [(2, "short")]
    names = ["a", "b", "c"]
    assert [bench.rotated(names, k) for k in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                          ["a", "b", "c"]]


def test_round_figures_time_ttft_and_the_decode_window_apart():
    # user 0: first token at 1 s, 5 tokens by 3 s; user 1: first at 2 s, 5 tokens by 4 s
    runs = [UserRun(1.0, 3.0, (1, 2, 3, 4, 5)), UserRun(2.0, 4.0, (6, 7, 8, 9, 10))]
    f = bench.round_figures(runs)
    assert f["aggregate_tok_s"] == 10 / 4.0  # every token over the round's wall time
    assert f["decode_tok_s"] == 8 / 3.0  # tokens after the first, from the first first token to the end
    assert f["per_user_tok_s"] == f["slowest_user_tok_s"] == 2.0  # 4 tokens in 2 s each
    assert f["ttft_p50_ms"] == 1500.0 and f["ttft_p95_ms"] == pytest.approx(1950.0)
    assert f["first_user_ttft_ms"] == 1000.0 and f["wall_s"] == 4.0


def _round(variant, cell, r, aggregate, tokens, warmup=False):
    figures = dict.fromkeys(bench.FIGURES, 1.0) | {"aggregate_tok_s": aggregate}
    return {"variant": variant, "cell": cell, "round": r, "warmup": warmup, "figures": figures, "tokens": tokens}


def test_summary_takes_medians_of_timed_rounds_and_per_round_ratios():
    rounds = [_round("paged-local", "1", 0, 999.0, [[1]], warmup=True),
              _round("reference", "1", 0, 1.0, [[1]], warmup=True)]
    for r, (ours, ref) in enumerate([(10, 20), (40, 10), (30, 30)]):
        rounds += [_round("paged-local", "1", r + 1, ours, [[1, 2]]),
                   _round("reference", "1", r + 1, ref, [[1, 2] if r else [1, 3]]),
                   _round("paged-local", "8", r + 1, 4 * ours, [[5], [6]]),
                   _round("paged-local", "1-long", r + 1, ours / 10, [[7]]),
                   _round("paged-local", "8-long", r + 1, ours / 2, [[7]])]
    s = bench.summarise(rounds, ["paged-local", "reference"])
    mine = s["paged-local"]["1"]
    assert mine["rounds"] == 3 and mine["aggregate_tok_s"] == 30  # the warm-up's 999 is not counted
    assert mine["aggregate_vs_reference"] == 1.0  # per round 0.5, 4, 1: the median, not 30/20
    assert s["paged-local"]["8"]["aggregate_vs_1_user"] == 4.0
    assert s["paged-local"]["8"]["aggregate_vs_reference"] is None  # no reference in that row
    assert s["paged-local"]["8-long"]["aggregate_vs_1_user"] == 5.0  # against the long row at 1 user
    assert mine["same_tokens_as_paged_local"] == "3/3"
    assert s["reference"]["1"]["same_tokens_as_paged_local"] == "2/3"
    t = bench.targets(s)
    assert t["scaling"]["verdict"] == t["vs_reference"]["verdict"] == bench.NOT_MEASURED  # no paged-ring


def test_targets_judge_the_paged_ring_at_eight_users():
    summary = {"paged-ring": {"8": {"aggregate_vs_1_user": 4.2, "aggregate_vs_reference": 0.9}}}
    t = bench.targets(summary)
    assert (t["scaling"]["verdict"], t["vs_reference"]["verdict"]) == ("met", "**missed**")


def test_prompts_are_distinct_and_the_long_one_is_about_its_length(tiny_checkpoint):
    from engine.generation.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(tiny_checkpoint("llama"))  # SmolLM2's tokenizer and chat template
    rng = random.Random(3)
    short = bench.make_prompts(tokenizer, 16, "short", rng, 8, 0)
    assert len({tuple(p) for p in short}) == 16 and max(map(len, short)) < 64
    again = bench.make_prompts(tokenizer, 16, "short", rng, 8, 0)
    assert not {tuple(p) for p in short} & {tuple(p) for p in again}  # a new nonce every round
    long = bench.make_prompts(tokenizer, 3, "long", rng, 8, 1024)
    assert 900 < len(long[0]) < 1150 and max(map(len, long[1:])) < 64


def test_a_long_row_past_the_context_is_refused_before_anything_loads():
    bench.check_fits(1024, 64, 8192, True)
    bench.check_fits(1024, 64, 512, False)  # no long row: only the short prompts must fit
    with pytest.raises(bench.BatchingSettingsError, match="context of 512: lower --long-tokens"):
        bench.check_fits(1024, 64, 512, True)


def test_the_template_names_the_command_and_measures_nothing(tmp_path):
    doc = tmp_path / "BENCH.md"
    doc.write_text("# Benchmarks\n\n<!-- other:start -->\nkept\n<!-- other:end -->\n")
    assert bench.run(_args(tmp_path, template=True)) == 0
    text = doc.read_text()
    assert "<!-- other:start -->\nkept\n<!-- other:end -->" in text
    section = text.split("<!-- batching:start -->", 1)[1].split("<!-- batching:end -->", 1)[0]
    assert ("`python -m tests.benchmarks batching --users 1,2,4,8,16 --new-tokens 64 --repeats 3 --warmups 1 "
            "--long-users '1,8' --long-tokens 1024 --threads 1`") in section
    for users, kind in [(1, "short"), (1, "long"), (16, "short"), (8, "long")]:
        for variant in bench.VARIANTS:
            assert f"| {users} | {kind} | {variant} |" in section
    assert "| 16 | long |" not in section
    assert "measured" not in section.replace(bench.NOT_MEASURED, "")
    assert not (tmp_path / "batching.json").exists()


def _toy_run(tmp_path, tiny_export, variants: str) -> dict:
    one, two = tiny_export("llama", 1), tiny_export("llama", 2)
    args = _args(tmp_path, exports=f"{one},{two}", reference="ours-ir", variants=variants, users="1,2",
                 long_users="2", long_tokens=100, new_tokens=4, repeats=1, warmups=1)
    assert bench.run(args) == 0
    return json.loads((tmp_path / "batching.json").read_text())


def _check(result: dict, ran: set[str]) -> None:
    assert {n for n, s in result["variants"].items() if s["ran"]} >= ran
    for name, status in result["variants"].items():
        if not status["ran"]:
            assert name.startswith("paged-") and "paged" in status["reason"]
    for name in ran:
        rows = result["summary"][name]
        assert set(rows) == {"1", "2", "2-long"}
        for s in rows.values():
            assert s["rounds"] == 1 and s["aggregate_tok_s"] > 0 and s["decode_tok_s"] > 0
            assert 0 < s["slowest_user_tok_s"] <= s["per_user_tok_s"]
            assert 0 < s["ttft_p50_ms"] <= s["ttft_p95_ms"] < 1000 * s["wall_s"]
            assert s["aggregate_vs_reference"] > 0
        assert rows["1"]["aggregate_vs_1_user"] == 1.0
    assert result["summary"]["reference"]["2"]["aggregate_vs_reference"] == 1.0
    assert result["summary"]["paged-local"]["2"]["same_tokens_as_paged_local"] == "2/2"
    timed = [r for r in result["rounds"] if not r["warmup"]]
    assert len(timed) == 3 * len([s for s in result["variants"].values() if s["ran"]])
    for r in result["rounds"]:
        assert all(len(t) == 4 for t in r["tokens"]) and len(r["tokens"]) == r["users"]
    long = next(r for r in timed if r["cell"] == "2-long")
    assert long["prompt_tokens"][0] > 80 > long["prompt_tokens"][1]
    assert result["settings"]["reference_threads"] == 2 and result["settings"]["prefix_caching"] is False
    assert result["variants"]["reference"]["scheduler"]["enable_prefix_caching"] is False
    assert len(result["machine"]["load_average"]) == 3


def test_a_toy_run_in_process_records_json_and_table(tmp_path, tiny_export):
    result = _toy_run(tmp_path, tiny_export, "paged-local,reference")
    _check(result, {"paged-local", "reference"})
    section = (tmp_path / "BENCH.md").read_text().split("<!-- batching:start -->", 1)[1]
    assert "python -m tests.benchmarks batching --users 1,2 --new-tokens 4 --repeats 1" in section
    assert "| 2 | long | paged-local | 1 |" in section and "| 2 | short | reference | 2 |" in section


def test_a_toy_run_with_every_variant_and_the_rings(tmp_path, tiny_export):
    result = _toy_run(tmp_path, tiny_export, ",".join(bench.VARIANTS))
    _check(result, {"paged-local", "paged-ring", "reference"})
    assert result["variants"]["paged-ring"]["inference_threads_total"] == 2
