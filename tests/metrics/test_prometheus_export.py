"""``/metrics`` as Prometheus reads it: the real exposition of a real served model (a paged ring of
worker processes behind the OpenAI API, the fleet's figures in the API's registry as the fleet
service puts them) passes ``promtool check metrics``, carries the families the issue names with
their ring, stage, agent and model labels, and every query of the Grafana dashboard in assets/
names a metric it exports."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from console.fleet.fleet_prometheus import FleetFigures, RingFigures
from console.fleet_api.agent_record import AgentRecord, AgentSource, Membership
from engine.control.hub_events import AgentEvent
from engine.control.messages import AgentStatus, FetchProgress, WorkerStatus
from tests.support.asyncutil import run

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "assets" / "grafana" / "deskfleet-dashboard.json"
POOL = 16 << 20
PROMTOOL = shutil.which("promtool")
NO_PROMTOOL = ("promtool is not installed (Debian: apt-get install --no-install-recommends prometheus; "
               "installer/bootstrap.sh installs it as root)")


def _record(name: str, *, restarts: int = 0, paused: tuple[str, ...] = ()) -> AgentRecord:
    status = AgentStatus(f"n-{name}", "fleet", name, "1", "serving", paused, {}, None, 1, FetchProgress(),
                         WorkerStatus(state="running", restarts=restarts, steps_per_s=12.5, streams=2), None,
                         cpu_percent=20.0, memory_used_bytes=3 << 30, hop_bytes_sent=4096)
    return AgentRecord(node_id=f"n-{name}", name=name, address="127.0.0.1", control_port=1, state="serving",
                       devices=("CPU",), memory_bytes=16 << 30, fleet_id="fleet", membership=Membership.MEMBER,
                       last_seen=1.0, sources=frozenset({AgentSource.HUB}), approved=True, status=status,
                       reachable=True, verified=True, paused_reasons=paused)


@pytest.fixture(scope="module")
def exposition(tiny_export) -> str:
    """The ``/metrics`` text after a few chat answers from a two-stage paged ring of worker processes."""
    from engine.api.server import ApiSettings, async_run_api
    from engine.generation.tokenizer import ChatTokenizer
    from engine.tools.local_fleet import paged_local_fleet

    export = tiny_export("llama", 2)

    async def main() -> str:
        tokenizer = await asyncio.to_thread(ChatTokenizer, export / "tokenizer")
        async with paged_local_fleet(export, exact=True, kv_pool_bytes=POOL) as ring:
            api = await async_run_api(ring, tokenizer, ApiSettings(default_max_tokens=6, max_tokens_limit=6,
                                                                   api_key="operator"))
            try:
                records = [_record("desk-a", restarts=1), _record("desk-b", paused=("user-active",))]
                figures = FleetFigures(lambda: [RingFigures("r1", ring.model.name, ring.metrics(),
                                                            {0: "service", 1: "desk-b"})],
                                       lambda: records, lambda: ["serving"])
                figures.pauses.on_event(AgentEvent("n-desk-b", "paused", {"reasons": ["user-active"]}, 0.0))
                figures.note_rebuild("r1")
                api.metrics.use_generator(figures)  # as the fleet service does
                async with openai.AsyncOpenAI(base_url=api.url, api_key="operator", max_retries=0,
                                              timeout=120) as client:
                    for text in ("Hello there", "What is a ring?"):
                        await client.chat.completions.create(model=ring.model.name, max_tokens=6,
                                                             messages=[{"role": "user", "content": text}])
                await ring.async_wait_idle()
                async with aiohttp.ClientSession() as http:
                    url = api.url.removesuffix("/v1") + "/metrics"
                    async with http.get(url, headers={"Authorization": "Bearer operator"}) as resp:
                        assert resp.status == 200 and resp.content_type == "text/plain"
                        return await resp.text()
            finally:
                await api.async_stop()

    return run(main(), 300)


def _samples(text: str) -> dict[str, list]:
    """Sample name -> its samples (prometheus_client's own parser: the text must parse)."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


@pytest.mark.slow
def test_promtool_accepts_the_real_exposition(exposition, tmp_path):
    if PROMTOOL is None:
        if os.environ.get("CI"):  # CI runs installer/bootstrap.sh as root: promtool must be there
            pytest.fail(NO_PROMTOOL)
        pytest.skip(NO_PROMTOOL)
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=exposition, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"promtool check metrics: {done.stdout}{done.stderr}"
    broken = exposition.replace("# TYPE deskfleet_api_ttft_seconds histogram",
                                "# TYPE deskfleet_api_ttft_seconds counter")  # promtool can fail: show it
    assert subprocess.run([PROMTOOL, "check", "metrics"], input=broken, capture_output=True, text=True,
                          timeout=60).returncode != 0


@pytest.mark.slow
def test_the_exposition_labels_rings_stages_agents_and_models(exposition):
    samples = _samples(exposition)
    model = next(s.labels["model"] for s in samples["deskfleet_api_ttft_seconds_count"])
    assert {s.labels["model"] for s in samples["deskfleet_api_time_per_output_token_seconds_count"]} == {model}
    stage = {(s.labels["ring"], s.labels["stage"], s.labels["agent"], s.labels["model"])
             for s in samples["deskfleet_stage_step_seconds_count"] if s.value > 0}
    assert ("r1", "1", "desk-b", model) in stage  # the remote stage's times, as its frames report them
    assert any(s.value > 0 for s in samples["deskfleet_ring_step_seconds_count"])
    for name in ("deskfleet_kv_blocks_used", "deskfleet_kv_blocks_free", "deskfleet_waiting_requests",
                 "deskfleet_prefix_hits_total", "deskfleet_failovers_total", "deskfleet_step_answered_rows_avg",
                 "deskfleet_ring_stage_moves_total"):
        assert [s.labels for s in samples[name]] == [{"ring": "r1", "model": model}], name
    assert samples["deskfleet_ring_rebuilds_total"][0].value == 1
    assert samples["deskfleet_first_hop_sent_bytes_total"][0].value > 0
    assert {s.labels["agent"]: s.value for s in samples["deskfleet_agent_hop_sent_bytes_total"]} == {
        "desk-a": 4096, "desk-b": 4096}
    by_agent = {s.labels["agent"]: s.value for s in samples["deskfleet_agent_pauses_total"]}
    assert by_agent == {"desk-a": 0, "desk-b": 1}
    assert {s.labels["agent"]: s.value for s in samples["deskfleet_agent_worker_restarts"]} == {"desk-a": 1,
                                                                                                "desk-b": 0}
    assert {s.labels["agent"]: s.value for s in samples["deskfleet_agent_paused"]} == {"desk-a": 0, "desk-b": 1}
    completion = {s.labels["key"]: s.value for s in samples["deskfleet_api_key_tokens_total"]
                  if s.labels["kind"] == "completion"}
    assert completion and sum(completion.values()) > 0
    # milliseconds are exposed in seconds; no family is written twice
    assert "_ms" not in exposition
    types = re.findall(r"^# TYPE (\S+) ", exposition, re.M)
    assert len(types) == len(set(types))


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL text of the dashboard: its panels' targets and its variables' queries."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    for var in dashboard.get("templating", {}).get("list", ()):
        query = var.get("query")
        exprs.append(query["query"] if isinstance(query, dict) else str(query))
    return exprs


@pytest.mark.slow
def test_every_dashboard_query_names_a_metric_the_service_exports(exposition):
    exported = set(_samples(exposition))
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    titles = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    assert {"Fleet overview", "Per-model latency", "Per-ring stage times", "Usage by person"} <= titles
    queries = dashboard_queries(dashboard)
    assert len(queries) > 20
    for expr in queries:
        names = re.findall(r"\bdeskfleet_[a-zA-Z0-9_]+", expr)
        assert names, f"the dashboard's query {expr!r} names no Deskfleet metric"
        missing = [n for n in names if n not in exported]
        assert not missing, f"the dashboard's query {expr!r} names {missing}, which /metrics does not export"
