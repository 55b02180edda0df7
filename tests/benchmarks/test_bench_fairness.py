"""The fairness benchmark's figures, and a toy run of it on the tiny model (the real one needs the
default model: ``python -m tests.benchmarks fairness``)."""

from __future__ import annotations

import argparse
import asyncio

from tests.benchmarks import fairness as bench


def test_p95_and_the_summary_are_medians_of_each_variants_rounds():
    assert bench.p95([1.0] * 9 + [5.0]) == 5.0 and bench.p95([float(x) for x in range(1, 21)]) == 19.0
    assert bench.p95([2.0]) == 2.0
    rounds = [{"load": load, "fair": fair, "ttft_p95_s": float(r + (load == "greedy"))}
              for r in range(3) for load, fair in bench.VARIANTS]
    assert bench.summarise(rounds) == {"alone-fair": 1.0, "greedy-fair": 2.0, "alone-fcfs": 1.0, "greedy-fcfs": 2.0}


def test_a_toy_run_on_the_tiny_model_measures_every_variant(tiny_export):
    args = argparse.Namespace(rounds=1, warmups=0, chats=1, chat_tokens=2, greedy_requests=1, greedy_tokens=4,
                              long_repeats=1, head_start=0.2, slots=4, threads=1)
    raw = asyncio.run(bench._async_run(args, tiny_export("llama", 1)))
    assert sorted((r["load"], r["fair"]) for r in raw["rounds"]) == sorted(bench.VARIANTS)
    assert all(len(r["ttfts"]) == 3 and r["ttft_p95_s"] > 0 for r in raw["rounds"])
