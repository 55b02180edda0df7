"""The office-big benchmark's pure parts: the bandwidth bound, the medians, the table. Its real run
needs the emulated office (root) and writes a ~3.4 GB checkpoint; tests/office runs the harness."""

from __future__ import annotations

import argparse

import pytest

from tests.benchmarks.office_big import bandwidth_bound, command_line, configure, render, summarise


def test_the_bound_is_the_bandwidth_over_the_bytes_a_token_streams():
    got = bandwidth_bound(5.0, streamed=1_000_000_000, gb_s=20.0)
    assert got["bound_tok_s"] == pytest.approx(20.0) and got["of_bound"] == pytest.approx(0.25)


def test_medians_and_the_table_say_the_load_and_the_refusal():
    p = argparse.ArgumentParser()
    configure(p)
    args = p.parse_args([])
    assert command_line(args).startswith(
        "python -m tests.benchmarks office-big --layers 8 --desks 2 --cores 1 --memory-mb 1400")
    result = {
        "sweep_gb_s": {"4 MiB": 3.0, "256 MiB": 2.0}, "streamed_bytes": 400_000_000, "weight_bytes": 500_000_000,
        "rounds": [{"users": 1, "tok_s": t, "decode_tok_s_per_user": t, "tokens": 32, "ttft_s": 1.0}
                   for t in (1.0, 2.0, 3.0)],
        "reported_memory_mb": {"desk-1": 1400.0, "desk-2": 1400.0},
        "plan": [{"pc": "desk-1", "layers": [0, 9], "memory_mb": 600.0}, {"pc": "desk-2", "layers": [10, 23],
                                                                           "memory_mb": 800.0}],
        "one_pc": {"status": 409, "message": "the model needs 0.4 GB more memory"},
        "layouts_one_pc": "the model needs 1.50 GB of memory", "proposed": "1 ring of 2",
        "desk_memory": {"desk-1": {"max_usage_bytes": 1 << 30, "limit_bytes": 1400 << 20, "oom_kills": 0}},
        "machine": {"cpu": "x86_64", "cores": 2, "load_average": [9.0, 8.0, 7.0]}, "load_after": [6.0, 6.0, 6.0],
        "settings": {"desks": 2, "cores": 0.5, "memory_mb": 1400}}
    summary = summarise(result)
    assert summary == [{"users": 1, "tok_s": 2.0, "decode_tok_s_per_user": 2.0, "rounds": 3, "bound_tok_s": 5.0,
                        "of_bound": 0.4}]
    text = render({**result, "summary": summary}, "CMD")
    assert "| 1 | 2.00 | 2.00 | 5.0 | 0.40 | 3 |" in text
    assert "load average [9.0, 8.0, 7.0]" in text and "not quiet-machine figures" in text
    assert "HTTP 409" in text and "proposes 1 ring of 2" in text and "OOM kills 0" in text
