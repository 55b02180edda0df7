"""``deskfleet serve --workers`` as a user runs it: a worker SIGKILLed mid-answer is restarted in
place and the streamed answer completes identical to an undisturbed one, while ``/health`` says
the ring is recovering (HTTP 200, not "ok") and names the stage; afterwards it is "ok" again."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

TIMEOUT = 120
MAX_TOKENS = 32


def _health(base: str, key: str = "k-1") -> tuple[int, dict]:
    """/health as a key holder sees it (a caller without the key gets the bare status)."""
    request = urllib.request.Request(f"{base}/health", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def _worker(server: subprocess.Popen, stage: int) -> psutil.Process:
    for child in psutil.Process(server.pid).children(recursive=True):
        argv = child.cmdline()
        if "worker" in argv and "--stage" in argv and argv[argv.index("--stage") + 1] == str(stage):
            return child
    raise AssertionError(f"serve --workers has no worker for stage {stage}")


def _stream(client, model: str, on_chunk=None) -> str:
    pieces = []
    for i, chunk in enumerate(client.completions.create(model=model, prompt="Hello, how are", max_tokens=MAX_TOKENS,
                                                        temperature=0, stream=True)):
        pieces.append(chunk.choices[0].text if chunk.choices else "")
        if on_chunk is not None:
            on_chunk(i)
    return "".join(pieces)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="sends SIGKILL/SIGTERM")
def test_a_worker_killed_under_serve_workers_is_restarted_and_the_answer_is_identical(tiny_export, tmp_path: Path):
    import openai

    log_path = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "engine.cli.main", "serve", "--shards", str(tiny_export("llama", 2)), "--workers",
            "--exact", "--port", "0", "--hold-timeout", "60", "--kv-pool-mb", "16", "--api-key-env", "DF_TEST_KEY",
            "--spares", "off"]  # a restart in place (a spare taking over: tests/tools/test_local_supervisor.py)
    with log_path.open("wb") as log:
        server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", "DF_TEST_KEY": "k-1"})
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        found = re.search(r"http://\S+/v1", line)
        assert found, f"{line!r}; log: {log_path.read_text()[-3000:]}"
        url = found.group(0)
        base = url.removesuffix("/v1")
        assert _health(base)[1]["status"] == "ok"
        client = openai.OpenAI(base_url=url, api_key="k-1", max_retries=0, timeout=TIMEOUT)
        model = client.models.list().data[0].id
        undisturbed = _stream(client, model)

        victim = _worker(server, 1)
        seen: list[tuple[int, dict]] = []

        def kill_then_look(i: int) -> None:
            if i != 6:
                return
            victim.send_signal(signal.SIGKILL)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                seen.append(_health(base))
                if seen[-1][1]["status"] != "ok":
                    return
                time.sleep(0.02)

        disturbed = _stream(client, model, kill_then_look)
        assert disturbed == undisturbed and len(undisturbed) > 0
        code, body = seen[-1]
        assert code == 200 and body["status"] == "recovering", seen[-1]
        (ring,) = body["rings"]
        assert ring["stage"] == 1 and "stage 1" in ring["detail"] and "SIGKILL" in ring["detail"]
        assert _worker(server, 1).pid != victim.pid  # restarted in place, a new process
        assert _health(base)[1]["status"] == "ok"
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=TIMEOUT) == 0, log_path.read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=TIMEOUT)
        server.stdout.close()


@pytest.mark.parametrize("flags, spares", [([], None), (["--spares", "on"], True), (["--spares", "off"], False)])
def test_serve_flags_become_the_supervision_options(flags, spares):
    import argparse

    from engine.cli.serve import configure, supervision

    p = argparse.ArgumentParser()
    configure(p)
    options = supervision(p.parse_args(["--shards", "x", "--workers", "--hold-timeout", "9", *flags]))
    assert options == {"failover": True, "hold_timeout_s": 9.0, "step_timeout_s": 30.0, "cache_dir": None,
                       "spares": spares}


def test_a_non_positive_hold_or_step_timeout_is_refused_by_name():
    import argparse

    from engine.cli.serve import configure, supervision
    from engine.errors import DeskfleetError

    p = argparse.ArgumentParser()
    configure(p)
    for flag in ("--hold-timeout", "--step-timeout"):
        with pytest.raises(DeskfleetError, match=flag):
            supervision(p.parse_args(["--shards", "x", "--workers", flag, "0"]))
