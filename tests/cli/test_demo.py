"""``deskfleet demo --serve``: the README's main command, as a user runs it (slow: default model)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

pytestmark = pytest.mark.slow


HEAVY_IMPORT = re.compile(r"^import time:.*\|\s+(torch|transformers|nncf)(\.\S+)?\s*$")


def test_demo_answers_then_serves_the_openai_api_and_stops_cleanly_on_sigint(tmp_path):
    import openai

    # A fresh cache: the demo prepares the embedded GGUF and exports it here, from nothing. Every
    # process (the demo and its workers) reports its imports, so torch anywhere shows.
    env = {**os.environ, "DESKFLEET_CACHE": str(tmp_path / "cache"), "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "demo", "--serve", "--port", "0",
                             "--max-new-tokens", "48"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)
    lines: list[str] = []
    url = None
    deadline = time.monotonic() + 900
    try:
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            match = re.search(r"serving .* at (http://\S+)", line)
            if match:
                url = match.group(1)
                break
        output = "".join(line for line in lines if not line.startswith("import time:"))
        assert url, output
        # Keep reading (later imports are reported too, and a full pipe would block the demo).
        drain = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        drain.start()
        assert "A: " in output and "Paris" in output, output
        assert re.search(r"\d+\.\d tok/s decode", output)
        fleet = [p for p in psutil.Process(proc.pid).children(recursive=True) if "worker" in " ".join(p.cmdline())]
        workers = [p for p in fleet if "--spare" not in p.cmdline()]  # warm spares, when memory allows, wait aside
        assert len(workers) == 2, "one worker process per stage"

        client = openai.OpenAI(base_url=url, api_key="unused", timeout=120)
        reply = client.chat.completions.create(model=client.models.list().data[0].id, temperature=0, max_tokens=32,
                                               messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
        code = proc.wait(timeout=120)
    assert code == 0
    drain.join(timeout=30)
    heavy = [line.strip() for line in lines if HEAVY_IMPORT.match(line)]
    assert heavy == [], f"the demo imported {heavy[:3]}"
    assert any(line.startswith("import time:") and "openvino" in line for line in lines), "imports are reported"
    assert all(not w.is_running() or w.status() == psutil.STATUS_ZOMBIE for w in fleet)
