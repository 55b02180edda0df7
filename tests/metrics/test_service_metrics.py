"""The fleet service's own ``/metrics``: its figures are in the OpenAI API's registry (one per service,
so this test's other servers do not leak in), promtool accepts them, and only the console's key and
keys issued for monitoring may read them (issue 29's rule)."""

from __future__ import annotations

import subprocess

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.envvars import KEYRING_DIR
from tests.fleet_service.conftest import service_in_process
from tests.metrics.test_prometheus_export import NO_PROMTOOL, PROMTOOL
from tests.support.asyncutil import run


def test_the_service_serves_its_fleet_figures_to_monitoring_keys_only(tmp_path, monkeypatch):
    monkeypatch.setenv(KEYRING_DIR, str(tmp_path / "keyring"))

    async def main():
        async with service_in_process(tmp_path / "fleet") as service:
            keys = service.host.keys
            monitor, person = keys.issue("grafana", metrics=True), keys.issue("alice")
            url = service.api_url.removesuffix("/v1") + "/metrics"
            got = {}
            async with aiohttp.ClientSession() as http:
                for who, secret in (("console", service.host.api_key), ("monitor", monitor.secret),
                                    ("person", person.secret), ("nobody", None)):
                    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
                    async with http.get(url, headers=headers) as resp:
                        got[who] = (resp.status, await resp.text())
            return got

    got = run(main(), 120)
    assert got["person"][0] == 403 and "metrics_forbidden" in got["person"][1]
    assert got["nobody"][0] == 401
    assert got["console"][0] == got["monitor"][0] == 200
    text = got["monitor"][1]
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"deskfleet_fleet_service_start_time_seconds", "deskfleet_fleet_agents", "deskfleet_fleet_rings",
            "deskfleet_api_requests", "deskfleet_api_ttft_seconds"} <= names
    # this server's own count (the console's read before), not another server's of this process
    assert [line for line in text.splitlines() if line.startswith("deskfleet_api_requests_total")] == [
        'deskfleet_api_requests_total{code="200"} 1.0']
    if PROMTOOL is None:
        pytest.skip(NO_PROMTOOL)
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
