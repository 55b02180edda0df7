"""People asking the fleet, through the real ``openai`` package, from a PC of the office:
``python -m tests.support.office.users CONFIG.json`` (run on a PC by :func:`ask`); one JSON line out.

Each user sends its own prompt (distinct prompts: no shared prefix cache between them) for greedy
``max_tokens``; all users at once. The key comes in the environment (OFFICE_API_KEY), never argv.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.office.pc import Pc

KEY_ENV = "OFFICE_API_KEY"
PROMPT = "Write a few sentences about office number {i}: who works there and what they do."


@dataclass(frozen=True)
class Answers:
    texts: list[str]
    completion_tokens: list[int]
    seconds: float
    first_token_s: list[float]

    @property
    def tokens_per_s(self) -> float:
        return sum(self.completion_tokens) / self.seconds if self.seconds else 0.0


async def _one(client, model: str, i: int, max_tokens: int, started: float) -> tuple[str, int, float]:
    first = None
    parts: list[str] = []
    tokens = 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT.format(i=i)}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - started
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(parts), tokens, first if first is not None else float("nan")


async def async_main(cfg: dict, key: str) -> dict:
    import openai

    headers = {"Host": cfg["host_header"]} if cfg.get("host_header") else None
    http_client = None
    if cfg.get("ca_file"):  # off loopback the fleet serves HTTPS under its own CA: pinned, as the product's clients do
        from engine.api.guard import api_client_context

        http_client = openai.DefaultAsyncHttpxClient(verify=api_client_context(Path(cfg["ca_file"]).read_bytes()))
    async with openai.AsyncOpenAI(base_url=cfg["base_url"], api_key=key, max_retries=0, timeout=cfg["timeout"],
                                  default_headers=headers, http_client=http_client) as client:
        model = cfg.get("model") or (await client.models.list()).data[0].id
        started = time.perf_counter()
        done = await asyncio.gather(*(_one(client, model, cfg["first_user"] + i, cfg["max_tokens"], started)
                                      for i in range(cfg["users"])))
        seconds = time.perf_counter() - started
    return {"model": model, "texts": [d[0] for d in done], "completion_tokens": [d[1] for d in done],
            "first_token_s": [d[2] for d in done], "seconds": seconds}


def ask(pc: Pc, base_url: str, key: str, *, users: int = 1, max_tokens: int = 16, first_user: int = 0,
        ca_file: Path | None = None, host_header: str | None = None, timeout: float = 300.0) -> Answers:
    """``users`` people on ``pc`` ask at once (``ca_file``: the fleet CA to pin for HTTPS; ``host_header``:
    the API's own host:port when ``base_url`` is a link emulator); an AssertionError naming the output if
    the client fails."""
    cfg = {"base_url": base_url, "users": users, "max_tokens": max_tokens, "first_user": first_user,
           "ca_file": None if ca_file is None else str(ca_file), "host_header": host_header, "timeout": timeout}
    config = pc.root / f"users-{time.monotonic_ns()}.json"
    config.write_text(json.dumps(cfg))
    done = pc.run([sys.executable, "-m", "tests.support.office.users", str(config)], timeout=timeout + 60,
                  env={KEY_ENV: key}, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, f"the users' client on {pc.name} failed:\n{done.stderr[-3000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return Answers(out["texts"], out["completion_tokens"], out["seconds"], out["first_token_s"])


if __name__ == "__main__":
    import os

    result = asyncio.run(async_main(json.loads(Path(sys.argv[1]).read_text()), os.environ[KEY_ENV]))
    print(json.dumps(result), flush=True)
