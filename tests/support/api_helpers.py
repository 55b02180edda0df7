"""A byte-level tokenizer, a model card and limits shared by the OpenAI schema and API tests."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from engine.api.server import ApiSettings
from engine.generation.generator import ModelCard
from engine.generation.reasoning import MARKERS

EOS = 256
CARD = ModelCard("fake", 64, (EOS,), 3)
SETTINGS = ApiSettings(max_prompt_tokens=40, default_max_tokens=20, max_tokens_limit=50)


class ByteTokenizer:
    """ids 0..255 are UTF-8 bytes, 256 is EOS (special: skipped when decoding)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class ThinkingByteTokenizer(ByteTokenizer):
    """A ByteTokenizer whose "template" thinks as Qwen3's does: ``enable_thinking`` false writes an
    empty block after the assistant's header; ``opens`` ends every prompt inside an open block."""

    thinking = MARKERS[0]
    template_variables = frozenset({"enable_thinking"})

    def __init__(self, opens: bool = False):
        self.opens = opens

    def encode_chat(self, messages, add_generation_prompt: bool = True, switches=None) -> list[int]:
        text = "".join(f"<{m['role']}>{m.get('reasoning_content', '')}|{m['content']}" for m in messages)
        text += "<assistant>"
        if (switches or {}).get("enable_thinking") is False:
            text += "<think>\n\n</think>\n\n"
        elif self.opens:
            text += "<think>\n"
        return self.encode(text)


@contextlib.contextmanager
def serve_process(*args: str, env: dict[str, str] | None = None, ready_timeout: float = 180,
                  timeout: float = 180) -> Iterator[str]:
    """``deskfleet serve ARGS --port 0`` in a subprocess: yields its API URL once it printed it; on a
    clean exit of the block, SIGTERM must stop it with code 0. Killed (and its pipes closed) in any case."""
    launcher = ("import argparse, sys; from engine.cli.serve import COMMAND; p = argparse.ArgumentParser(); "
                "COMMAND.configure(p); sys.exit(COMMAND.run(p.parse_args(sys.argv[1:])))")
    proc = subprocess.Popen([sys.executable, "-c", launcher, *args, "--port", "0"], cwd=Path(__file__).parents[2],
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], ready_timeout)  # the server prints its URL once ready
        line = proc.stdout.readline() if ready else ""
        url = re.search(r"http://\S+/v1", line)
        assert url, f"no URL in {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        yield url.group(0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=timeout) == 0, "the server did not stop cleanly on SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=timeout)
        proc.stdout.close()
        proc.stderr.close()
