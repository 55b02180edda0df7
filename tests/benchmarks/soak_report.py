"""The soak benchmark's Markdown section: one column per runtime (today the paged one), its speed
target, and where every process's memory went (:mod:`tests.benchmarks.soak`)."""

from __future__ import annotations

from typing import Any

from tests.benchmarks.record import markdown_table


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def _pct_cell(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:+.2f} %"


def _measure_rows(summaries: dict[str, dict[str, Any]], comparison: dict[str, Any]) -> list[list[Any]]:
    names = list(summaries)

    def row(label: str, cell, target: str = "", verdict: str = "") -> list[Any]:
        return [label, *(cell(summaries[r]) for r in names), target, verdict]

    paged = "paged" in summaries
    rows = [row("requests served (of which after warm-up)", lambda s: f"{s['served']} ({s['timed_requests']})"),
            row("failed requests", lambda s: s["failed"], "0",
                " / ".join(f"{r}: {s['no_failures']}" for r, s in summaries.items())),
            row("TTFT ms p50 / p95 (streamed)", lambda s: f"{fmt(s['ttft_ms_p50'])} / {fmt(s['ttft_ms_p95'])}",
                "paged p95 ≤ 1000" if paged else "", comparison.get("ttft_verdict", "")),
            row("decode tok/s per request p50 / p95",
                lambda s: f"{fmt(s['decode_tok_s_p50'])} / {fmt(s['decode_tok_s_p95'])}"),
            row("aggregate tok/s (4 users)", lambda s: fmt(s["aggregate_tok_s"], ".2f")),
            row("prefix-cache hits (tokens reused)", lambda s: f"{s['prefix_hits']} ({s['prefix_tokens_reused']})"),
            row("RSS growth, all processes (after warm-up to end)", lambda s: _pct_cell(s["rss_growth"]), "< 5 %",
                " / ".join(f"{r}: {s['rss_verdict']}" for r, s in summaries.items())),
            row("the same without the KV pool's newly touched pages",
                lambda s: _pct_cell(s["rss_growth_without_pool"])),
            row("longest gap between streamed chunks, ms: alone / while 3 × 512 KiB prompts are refused",
                _stall_cell)]
    return rows


def _stall_cell(s: dict[str, Any]) -> str:
    probe = s.get("stall_probe")
    if not probe:
        return "n/a"
    ms = [None if probe[k]["max_s"] is None else 1000 * probe[k]["max_s"] for k in ("alone", "refusing")]
    refused = sum(code == 400 for code in probe["statuses"])
    return f"{fmt(ms[0])} / {fmt(ms[1])} ({refused} of {len(probe['statuses'])} refused)"


def _memory_rows(summaries: dict[str, dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for r, s in summaries.items():
        for name, m in s["memory"].items():
            def moved(kind: str, m: dict[str, Any] = m) -> str:
                return f"{fmt(m[f'warm_{kind}_mb'])} → {fmt(m[f'end_{kind}_mb'])}"

            rows.append([r, name, fmt(m["idle_rss_mb"]), moved("rss"), _pct_cell(m["growth"]), moved("file"),
                         moved("kv_pool") if m["kv_pool_mappings"] else "–", moved("other_anon")])
    return rows


def _pool_note(s: dict[str, Any]) -> str:
    """What the paged workers' block pool did, from the measured split."""
    blocks, tensor = s["metrics"].get("kv_blocks_total"), s.get("pool_tensor_bytes")
    workers = {n: m for n, m in s["memory"].items() if m["kv_pool_mappings"]}
    if not workers or not tensor:
        return (f"The paged workers' block pool ({fmt(blocks, '.0f')} blocks per stage) could not be told apart in "
                "smaps (no mapping of one cache tensor's size), so it is inside *other anon*.")
    cells = []
    for name, m in workers.items():
        full = m["kv_pool_mappings"] * tensor / 2**20
        cells.append(f"{name} {fmt(m['warm_kv_pool_mb'])} of {fmt(full)} MiB after the warm-up, "
                     f"{fmt(m['end_kv_pool_mb'])} at the end")
    grew = any(m["end_kv_pool_mb"] - m["warm_kv_pool_mb"] > 1 for m in workers.values())
    return (f"The paged workers' block pool ({fmt(blocks, '.0f')} blocks per stage besides the scratch blocks, "
            "allocated at the first step) "
            f"was resident: {'; '.join(cells)}. "
            + ("Its pages became resident as blocks were first written, so part of the growth is the pool "
               "filling; the row *without the KV pool's newly touched pages* leaves that out." if grew else
               "It added nothing to the growth after the warm-up."))


def section(command: str, info: dict[str, Any], result: dict[str, Any], what: str) -> str:
    summaries, comparison = result["summaries"], result["comparison"]
    names = list(summaries)
    minutes, segments, warmup = result["minutes"], result["segments"], result["warmup_s"]
    per_segment = minutes / segments
    options = "; ".join(f"{r}: `deskfleet serve --workers {s['serve_options']}`" for r, s in summaries.items())
    seg_rows = [[r, seg["index"] + 1, f"{seg['start_s']:.0f}–{seg['end_s']:.0f}", seg["served"], seg["failed"],
                 fmt(seg["aggregate_tok_s"], ".2f"), fmt(seg["ttft_ms_p50"])]
                for r, s in summaries.items() for seg in s["segments"]]
    seg_rows.sort(key=lambda row: float(row[2].split("–")[0]))
    served = sum(s["served"] for s in summaries.values())
    pool_note = ""
    if "paged" in summaries:
        pool_note = " " + _pool_note(summaries["paged"])
    fleets = (f"one fleet per runtime ({options}), all started before the first request and driven in turn: "
              f"{segments} segment(s) of {per_segment:g} min per runtime in the order {' '.join(result['order'])}, "
              "the other fleets idle meanwhile; segment *i* of every runtime starts from the same conversation seed"
              if len(names) > 1 else
              f"one fleet ({options}), driven in {segments} segment(s) of {per_segment:g} min, segment *i* from "
              "conversation seed *i*")
    return (f"## Soak: {'/'.join(names)} × 4 chat users against a local fleet, {minutes:g} min each\n\n"
            f"`{command}` → `docs/bench/soak.json` ({info['date']}, {info['cores']} cores, OpenVINO "
            f"{info['openvino']}, load average at start {info['load_average']}). {what} behind the OpenAI API, "
            f"each stage in its own worker process, {fleets}. The stateful runtime, driven beside the paged one "
            "until issue 27 retired it from serving, is in the history below. 4 users with the "
            "`openai` client holding multi-turn conversations (up to 6 turns, each resending the history, so the "
            "prefix cache is exercised), short/medium/long prompts, 16-128 new tokens, greedy, about half streamed. "
            f"{served} requests in all. Speed figures count the requests started after the warm-up (the "
            f"first {warmup:g} s of a runtime's first segment); failures count every request.\n\n"
            + markdown_table(["measure", *names, "target", "verdict"], _measure_rows(summaries, comparison))
            + "\n\n" + markdown_table(["runtime", "segment", "s into the run", "served", "failed", "tok/s",
                                       "TTFT ms p50"], seg_rows)
            + "\n\nRSS in MB per process, after the warm-up → at the end, and what it is made of (from "
            f"`/proc/<pid>/smaps`, glibc's mmap threshold fixed at {result.get('mmap_threshold_mb', 0):g} MiB in "
            "every fleet so that every large allocation is a mapping of its own: *file* = mapped files, the "
            "weights and libraries; *KV pool* = the anonymous "
            "mappings of one cache tensor's size in a paged worker; *other anon* = everything else: heaps, "
            "compiled kernels and OpenVINO's per-shape caches):\n\n"
            + markdown_table(["runtime", "process", "RSS at startup", "RSS", "growth", "file", "KV pool",
                              "other anon"], _memory_rows(summaries))
            + "\n\nWhat still grows. The step's token count is bucketed, so OpenVINO caches kernels for few input "
            "shapes (see *Shape caches*, `python -m tests.benchmarks shape-caches`, for what new shapes cost); "
            "the KV states live in the pool." + pool_note
            + " The RSS of every process, sampled every 10 s, is in the JSON."
            + "".join(f"\n- {r} failure: `{f}`" for r, s in summaries.items() for f in s["failures"]))
