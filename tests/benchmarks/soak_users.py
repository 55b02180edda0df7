"""The soak benchmark's users: multi-turn chat conversations over the OpenAI API, driven by the real
``openai`` client (``AsyncOpenAI``), one client per user.

A user keeps a conversation going for a few turns (each turn resends the whole history, so the
coordinator's prefix cache serves the shared part), then starts a new one; prompts are short,
medium or long, answers 16-128 tokens, about half streamed. What to say next is a pure decision
(:func:`plan_turn`); :func:`async_user` only sends it and records what came back.

:func:`async_stall_probe` is the API's guard against huge prompts, measured: the gaps between a
streamed answer's chunks alone, then while prompts far over the prompt limit are sent and refused.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

SHORT = ("What is a GPU?", "Say hello to the office.", "Name three rivers in Europe.", "Why is the sky blue?",
         "Give me a haiku about printers.", "What is 17 times 23?", "Suggest a name for a cat.",
         "Is a tomato a fruit?")
MEDIUM = (
    "Our office has forty desktop PCs that sit idle every night. Explain in plain words how their spare "
    "cycles could run a language model together, and what could go wrong.",
    "Summarise the trade-offs between running a model on one large server and splitting it across "
    "several small machines on a local network, for an IT manager.",
    "Write a short, friendly email telling colleagues that their PCs may serve requests after hours, "
    "and that anything they do at the keyboard takes priority.",
    "List five things to check before letting a background service use a laptop's CPU while it is on "
    "battery, and say why each matters.",
)
LONG_PARAGRAPH = (
    "The quarterly report covers the migration of the accounting department to the new building, the "
    "replacement of the ageing printers on the second floor, the pilot of the shared calendar, and the "
    "results of the staff survey on remote work. Most teams moved without disruption; two servers had "
    "to be reinstalled after a power cut, and the help desk handled twice the usual number of tickets "
    "in the first week. ")
LONG = tuple(LONG_PARAGRAPH * n + question for n, question in (
    (2, "Summarise this report in three sentences."), (3, "What were the main problems, and how were they fixed?"),
    (4, "Draft a one-paragraph note to the board about this quarter.")))
MAX_TOKENS = (16, 32, 48, 64, 128)
MAX_TURNS = 6
SYSTEM = {"role": "system", "content": "You are a helpful assistant in a busy office. Answer briefly."}


@dataclass(frozen=True)
class Turn:
    text: str
    max_tokens: int
    stream: bool


def plan_turn(rng: random.Random, turns_done: int, history_tokens: int, chars_per_token: float,
              budget_tokens: int) -> Turn | None:
    """The next user message, or None to start a new conversation (too many turns, or the history
    plus this message and its answer would not fit ``budget_tokens``)."""
    if turns_done >= MAX_TURNS:
        return None
    pool = rng.choices((SHORT, MEDIUM, LONG), weights=(5, 3, 1))[0]
    text = rng.choice(pool)
    max_tokens = rng.choice(MAX_TOKENS)
    need = history_tokens + len(text) / chars_per_token + 16 + max_tokens
    if need > budget_tokens:
        if turns_done:
            return None
        text, max_tokens = rng.choice(SHORT), MAX_TOKENS[0]  # a fresh conversation always fits its opener
    return Turn(text, max_tokens, stream=rng.random() < 0.5)


@dataclass
class Outcome:
    """One request as the user saw it."""

    user: int
    turn: int
    stream: bool
    started: float  # time.monotonic()
    seconds: float
    ok: bool
    error: str | None = None
    ttft_s: float | None = None  # streamed requests: until the first text arrived
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens per second after the first one (streamed), or over the whole request (plain)."""
        if not self.ok or self.completion_tokens < 2:
            return None
        span = self.seconds - (self.ttft_s or 0.0)
        return (self.completion_tokens - (1 if self.ttft_s is not None else 0)) / span if span > 0 else None


async def _ask(client: Any, model: str, messages: list[dict], turn: Turn) -> tuple[str, float | None, int, int]:
    """(answer text, time to first text or None, prompt tokens, completion tokens)."""
    started = time.monotonic()
    if not turn.stream:
        answer = await client.chat.completions.create(model=model, messages=messages, max_tokens=turn.max_tokens,
                                                      temperature=0)
        return (answer.choices[0].message.content or "", None, answer.usage.prompt_tokens,
                answer.usage.completion_tokens)
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=turn.max_tokens,
                                                  temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, first, usage = [], None, None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.monotonic() - started
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    if usage is None:
        raise RuntimeError("the stream ended without its usage chunk")
    return "".join(pieces), first, usage.prompt_tokens, usage.completion_tokens


async def async_user(index: int, url: str, model: str, *, deadline: float, budget_tokens: int, seed: int,
                     outcomes: list[Outcome], timeout_s: float = 300.0) -> None:
    """Hold conversations until ``time.monotonic()`` passes ``deadline``, appending every request's
    :class:`Outcome`. A failed request ends its conversation; the user starts another."""
    import openai

    rng = random.Random(seed * 1000 + index)
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=timeout_s) as client:
        while time.monotonic() < deadline:
            messages, history, chars_per_token, turns = [SYSTEM], 0, 1.0, 0
            while time.monotonic() < deadline:
                turn = plan_turn(rng, turns, history, chars_per_token, budget_tokens)
                if turn is None:
                    break
                messages.append({"role": "user", "content": turn.text})
                started = time.monotonic()
                try:
                    text, ttft, prompt_tokens, completion_tokens = await _ask(client, model, messages, turn)
                except Exception as exc:  # recorded as a failure; the benchmark's verdict counts them
                    outcomes.append(Outcome(index, turns, turn.stream, started, time.monotonic() - started, False,
                                            f"{type(exc).__name__}: {exc}"[:300]))
                    break
                outcomes.append(Outcome(index, turns, turn.stream, started, time.monotonic() - started, True, None,
                                        ttft, prompt_tokens, completion_tokens))
                messages.append({"role": "assistant", "content": text})
                chars = sum(len(m["content"]) for m in messages[:-1])
                chars_per_token = max(chars / max(prompt_tokens, 1), 0.5)
                history = prompt_tokens + completion_tokens
                turns += 1


OVERSIZED_CHARS = 512 << 10  # under the API's default 1 MiB body limit, far over its prompt limit
OVERSIZED_PROMPTS = 3


async def async_chunk_gaps(url: str, model: str, *, key: str = "unused", max_tokens: int = 96) -> list[float]:
    """Seconds between the text chunks of one streamed chat answer: what a stall of the API's loop shows as."""
    import openai

    gaps: list[float] = []
    last = None
    async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=300) as client:
        stream = await client.chat.completions.create(
            model=model, messages=[SYSTEM, {"role": "user", "content": MEDIUM[0]}], max_tokens=max_tokens,
            temperature=0, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return gaps


def send_oversized(url: str, model: str, count: int, *, key: str = "unused") -> list[int]:
    """``count`` chat requests of OVERSIZED_CHARS, one after another (a client elsewhere: call it in
    a thread); the HTTP status of each (400 context_length_exceeded expected)."""
    import openai

    big = "capital " * (OVERSIZED_CHARS // 8)
    statuses = []
    with openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=300) as client:
        for _ in range(count):
            try:
                client.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": big}])
                statuses.append(200)
            except openai.APIStatusError as exc:
                statuses.append(exc.status_code)
    return statuses


async def async_stall_probe(url: str, model: str, *, key: str = "unused",
                            count: int = OVERSIZED_PROMPTS) -> dict[str, Any]:
    """Chunk gaps of streamed answers alone, then of answers streamed back to back while ``count``
    oversized prompts are refused: max and median seconds of each, and the refusals' statuses."""
    alone = await async_chunk_gaps(url, model, key=key)
    refusals = asyncio.ensure_future(asyncio.to_thread(send_oversized, url, model, count, key=key))
    loaded: list[float] = []
    while not refusals.done() or not loaded:
        loaded += await async_chunk_gaps(url, model, key=key)
    statuses = await refusals

    def figures(gaps: list[float]) -> dict[str, float | None]:
        return {"max_s": max(gaps, default=None), "median_s": statistics.median(gaps) if gaps else None,
                "gaps": len(gaps)}

    return {"alone": figures(alone), "refusing": figures(loaded), "statuses": statuses,
            "prompt_chars": OVERSIZED_CHARS}
