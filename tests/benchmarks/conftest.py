"""The benchmarks' own tests. A test that runs a benchmark for real (exports, worker processes, a
fleet on loopback, a built wheel) belongs to the slow lane; the pure parts (plans, fits, ratios,
rendering) and one real run (the shape-cache benchmark, a few seconds) stay in the fast lane."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent

# test module -> its tests that run a benchmark for real ("*": every test of the module).
SLOW = {
    "test_bench_batching": {"test_a_toy_run_with_every_variant_and_the_rings"},  # worker processes
    "test_bench_console_fleet": {"test_a_tiny_run_under_xvfb_records_json_section_and_a_screenshot"},  # processes
    "test_bench_fairness": {"test_a_toy_run_on_the_tiny_model_measures_every_variant"},  # two paged servers
    "test_bench_export_memory": {"test_the_checkpoint_is_hf_shards_with_an_index_that_reads_back",
                                 "test_a_real_export_stays_within_the_issue_bound"},
    "test_bench_fleet_scale": "*",  # a service process and a worker of simulated agents
    "test_bench_gguf_keep": "*",  # every test reads the one real run of four exports
    "test_bench_moe_export": {"test_a_toy_run_exports_serves_and_records"},  # an export child, a worker process
    "test_bench_parity": {"test_parity_runs_every_variant_and_records_json_and_table"},
    "test_bench_rings": {"test_a_toy_run_records_json_and_section"},  # worker processes, serve restarted
    "test_bench_samplers": {"test_a_tiny_run_records_json_and_section"},  # worker processes
    "test_bench_placement": {"test_the_core_places_distributes_and_measures_two_agents"},
    "test_bench_soak": {"test_one_minute_soak_on_the_tiny_model_fails_no_request"},
    "test_not_shipped": {"test_the_wheel_carries_no_benchmark", "test_the_deb_carries_no_benchmark"},
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects anything
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.parent != HERE or item.path.stem not in SLOW:
            continue
        slow = SLOW[item.path.stem]
        if slow != "*":
            missing = sorted(n for n in slow if not hasattr(item.module, n))
            if missing:
                raise pytest.UsageError(f"tests/benchmarks/conftest.py lists tests {item.path.name} no "
                                        f"longer has: {missing}")
        if slow == "*" or item.originalname in slow:
            item.add_marker(pytest.mark.slow)
