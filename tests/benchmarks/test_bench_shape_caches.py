"""The shape-cache benchmark's core on the tiny model: three variants, each in its own process
with real OpenVINO, summarised and rendered into a Markdown section."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.benchmarks.shape_caches import VARIANTS, findings, render, rss_at, run, run_variant


def test_the_benchmark_runs_every_variant_in_its_own_process_and_records_them(tmp_path, tiny_export):
    doc, out = tmp_path / "BENCHMARKS.md", tmp_path / "shape_caches.json"
    doc.write_text("# Benchmarks\n\n<!-- other:start -->\nkept\n<!-- other:end -->\n")
    args = argparse.Namespace(shards=tiny_export("llama", 2), streams=12, measure_from=4, max_prompt=40,
                              decode_steps=3, runs=1, warmups=0, tokens=0, json=out, doc=doc)
    assert run(args) == 0

    result = json.loads(out.read_text())
    assert set(result["variants"]) == set(VARIANTS)
    for row in result["variants"].values():
        (child,) = row["runs"]
        assert [n for n, _ in child["rss"]] == [0, 10, 12]  # sampled every 10 streams and at the end
        assert row["decode_ms"] > 0 and row["prefill_ms_per_token"] > 0 and row["rss_end_mb"] > 0
        assert row["rss_start_mb"] == rss_at(child["rss"], 4) == child["rss"][1][1]
    assert result["ratios"]["decode off/default"] == pytest.approx(
        result["variants"]["off"]["decode_ms"] / result["variants"]["default"]["decode_ms"])
    text = doc.read_text()
    assert "kept" in text and "<!-- shape-caches:start -->" in text and "| repeated |" in text
    assert render(result, out) in text


def test_the_off_variant_refuses_to_run_with_the_primitive_cache_on(tiny_export, monkeypatch):
    # The oneDNN cache size is read once per process: measuring "off" without it would be a lie.
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    with pytest.raises(RuntimeError, match="ONEDNN_PRIMITIVE_CACHE_CAPACITY=0"):
        run_variant(tiny_export("llama", 2), "off", streams=1, measure_from=0, max_prompt=16, decode_steps=1, seed=0)
    with pytest.raises(ValueError, match="unknown variant"):
        run_variant(tiny_export("llama", 2), "sometimes", streams=1, measure_from=0, max_prompt=16, decode_steps=1,
                    seed=0)


def test_the_findings_tell_shape_caching_from_a_leak():
    def rows(fresh, same, off):
        return {k: {"growth_pct": g, "rss_start_mb": 200.0} for k, g in zip(VARIANTS, (fresh, same, off), strict=True)}

    ratios = {"decode off/default": 1.1, "prefill off/default": 1.2}
    text = "\n".join(findings(rows(12.0, 0.1, 1.5), ratios))
    assert "shape-keyed caching" in text and "leak" in text and "1.10× the decode" in text
    text = "\n".join(findings(rows(12.0, 6.0, 1.5), ratios))
    assert "shape-keyed" not in text and "look for a leak" in text
