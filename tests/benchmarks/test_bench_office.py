"""The office benchmark's pure parts: --quick's settings, the medians and ratios, the table. Its real
run needs the emulated office (root); tests/office/test_office.py runs that harness in the slow lane."""

from __future__ import annotations

import argparse

from tests.benchmarks.office import (
    apply_quick,
    command_line,
    configure,
    layout_check,
    measured_layout,
    render,
    summarise,
)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    configure(p)
    return apply_quick(p.parse_args(list(argv)))


def test_quick_is_the_smallest_run_once_and_says_so():
    args = _args("--quick", "--desks", "4")
    assert (args.desks, args.cores, args.users, args.tokens, args.rounds) == (2, 0.5, "1,2", 16, 1)
    assert command_line(args) == "python -m tests.benchmarks office --quick"
    assert "--desks 4 --cores 1" in command_line(_args("--desks", "4"))


def test_medians_over_rounds_and_each_layout_against_one_pc():
    def row(r, layout, users, tok_s):
        return {"round": r, "layout": layout, "users": users, "tok_s": tok_s, "ttft_s": 0.1 * (r + 1),
                "busy": {"desk-1": 0.5 + r / 10, "desk-2": 0.25}}

    rows = [row(r, lay, 2, t) for r, (a, b) in enumerate([(10, 30), (20, 40), (30, 50)])
            for lay, t in (("one", a), ("ring", b))]
    summary = summarise(rows)
    assert [(s["layout"], s["users"], s["tok_s"], s["rounds"]) for s in summary] == [("one", 2, 20, 3),
                                                                                     ("ring", 2, 40, 3)]
    assert summary[1]["vs_one"] == 2.0 and summary[0]["busy"] == {"desk-1": 0.6, "desk-2": 0.25}
    text = render({"settings": {"desks": 2, "cores": 1.0, "memory_mb": 3072, "tokens": 64, "rounds": 3},
                   "machine": {"cpu": "x86_64", "load_average": [0.1, 0.1, 0.1]}, "summary": summary}, "CMD")
    assert "| ring | 2 | 40.0 | 0.20 | 2.00 | 0.60, 0.25 |" in text and "    CMD" in text


def test_the_layout_check_sets_the_proposal_against_the_measured_best():
    assert [measured_layout(n, 2) for n in ("1 copy", "2 copies", "1 ring of 2", "1 copy + 1 ring of 2")] == [
        "one", "copies", "ring", None]
    summary = [{"layout": lay, "users": u, "tok_s": t} for lay, u, t in (
        ("one", 1, 30.0), ("copies", 1, 29.0), ("ring", 1, 25.0),
        ("one", 8, 60.0), ("copies", 8, 100.0), ("ring", 8, 90.0),
        ("one", 16, 70.0), ("copies", 16, 120.0), ("ring", 16, 101.0))]

    def proposal(name: str) -> list[dict]:
        return [{"name": name, "tok_s_users": 99.0}]

    checks = layout_check(summary, {1: proposal("2 copies"), 8: proposal("1 ring of 2"), 16: proposal("1 ring of 2"),
                                    2: proposal("2 copies")}, desks=2)
    assert [(c["users"], c["best"], c["verdict"]) for c in checks] == [
        (1, "one", "within 15% of the best"), (8, "copies", "within 15% of the best"), (16, "copies", "miss")]
    assert layout_check(summary, {8: proposal("2 copies")}, 2)[0]["verdict"] == "the measured best"
    assert layout_check(summary, {8: proposal("1 copy + 1 ring of 2")}, 3)[0]["verdict"] == "not measured here"
    text = render({"settings": {"desks": 2, "cores": 1.0, "memory_mb": 3072, "tokens": 64, "rounds": 3},
                   "machine": {"cpu": "x86_64", "load_average": [0.1, 0.1, 0.1]}, "summary": [],
                   "layout_check": checks}, "CMD")
    assert "| 16 | 1 ring of 2 | 99.0 | 101.0 | copies 120.0 | miss |" in text
