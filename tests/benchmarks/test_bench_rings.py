"""`python -m tests.benchmarks rings` (issue 15, Deliver 8): its figures, medians and section, and a
toy run on the 1-stage tiny model (2 users, 4 tokens, 1 and 2 rings, the serve process restarted
and sampled idle; the fleet-service phase is left to the fleet service's own restart test) whose
JSON must have its shape and sane numbers. No speed is asserted."""

from __future__ import annotations

import argparse
import json
import random

from tests.benchmarks import rings as bench


def _args(tmp_path, **over) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.configure(p)
    argv = ["--json", str(tmp_path / "rings.json"), "--doc", str(tmp_path / "BENCH.md")]
    for k, v in over.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return p.parse_args(argv)


def test_round_figures_and_medians():
    f = bench.round_figures(2.0, [0.1, 0.3, 0.2], [10, 10, 20])
    assert f["aggregate_tok_s"] == 20.0 and f["ttft_p50_s"] == 0.2 and f["ttft_p95_s"] == 0.3
    rounds = [{"rings": 1, "warmup": True, **bench.round_figures(1.0, [9.0], [1])},
              *({"rings": 1, "warmup": False, **bench.round_figures(w, [0.1], [10])} for w in (1.0, 2.0, 4.0))]
    s = bench.summarise(rounds)["1"]
    assert s["aggregate_tok_s"] == 5.0 and s["rounds"] == 3  # the warm-up round is left out


def test_rotation_and_prompts_are_distinct():
    assert [bench.rotated([1, 2], k) for k in range(3)] == [[1, 2], [2, 1], [1, 2]]
    chats = bench.user_messages(8, random.Random(0))
    assert len({c[0]["content"] for c in chats}) == 8
    assert bench.percentile([], 0.5) != bench.percentile([], 0.5)  # NaN: nothing measured


def test_section_names_the_shared_cores_and_the_restart_target(tmp_path):
    rounds = [{"rings": n, "round": 0, "warmup": False, "per_ring": {"ring-0": 4.0, "ring-1": 4.0} if n == 2 else {},
               **bench.round_figures(1.0, [0.1], [8 * n])} for n in (1, 2)]
    service = {"rings": 2, "workers": 4, "idle_seconds": 10.0, "restart_to_first_answer_s": 31.0,
               "idle_cpu_pct_service": 0.5, "idle_cpu_pct_workers": 1.0, "rss_mb_service": 100.0,
               "rss_mb_workers": 400.0}
    result = {"machine": {"date": "d", "cpu": "c", "cores": 2, "load_average": [0.1]}, "export": "e", "stages": 2,
              "settings": {"users": 8, "threads": 1}, "rounds": rounds, "summary": bench.summarise(rounds),
              "service": service, "fleet": {"restart_to_first_answer_s": 12.0, "restart_to_admin_s": 2.0,
                                             "idle_seconds": 10.0, "idle_cpu_pct": 1.0, "rss_mb": 150.0}}
    text = bench.render(result, bench.command_line(_args(tmp_path)))
    assert "this machine's cores" in text and "| 2 | 16.0 | 2.00 |" in text and "4/4" in text
    assert "31.0 s" in text and "**missed**" in text
    assert "`deskfleet fleet`" in text and "12.0 s | <= 30 s: met" in text


def test_a_toy_run_records_json_and_section(tmp_path, tiny_export):
    args = _args(tmp_path, export=tiny_export("llama", 1), users=2, new_tokens=4, repeats=1, warmups=0, idle_seconds=1,
                 kv_pool_mb=16, no_fleet=True)
    assert bench.run(args) == 0
    result = json.loads((tmp_path / "rings.json").read_text())
    assert set(result["summary"]) == {"1", "2"}
    assert all(s["aggregate_tok_s"] > 0 and s["tokens"] >= 2 for s in result["summary"].values())
    two = next(r for r in result["rounds"] if r["rings"] == 2)
    assert sum(two["per_ring"].values()) == 2  # both users' requests went through the 2-ring router
    service = result["service"]
    assert service["workers"] >= 2 and 0 < service["restart_to_first_answer_s"] < 600
    assert service["rss_mb_service"] > 0 and service["idle_cpu_pct_service"] >= 0
    assert "<!-- rings:start -->" in (tmp_path / "BENCH.md").read_text()
