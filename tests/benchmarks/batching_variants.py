"""The batching benchmark's variants: how each is started, and one round of N concurrent users on it.

A variant that generates through Deskfleet is a factory returning a started
:class:`engine.generation.generator.Generator` (an async context manager); every such variant is
driven the same way (:func:`generator_round`: N ``stream()`` calls at once, each token timed as it
arrives). The reference, ``openvino_genai.ContinuousBatchingPipeline``, is driven by its own
``add_request``/``step`` loop (:class:`ReferenceServer`), each request's new tokens read after every
step, so its TTFT and decode window are timed per user the same way.

A variant that cannot run here yet raises :class:`VariantUnavailable` on entry, with the reason the
table prints (the paged coordinator while its modules do not import).

The stateful runtime's variants (``stateful-local``, ``stateful-ring``: a stateful infer request
per user) were dropped when that runtime was retired from serving (issue 27); the paged runtime
serves CPU and GPU alone. Their last figures stay in docs/BENCHMARKS.md's history.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import DeskfleetError
from engine.generation.generator import Generator

# The token budget per step of every batched variant: the paged scheduler's default and the
# reference's max_num_batched_tokens.
TOKEN_BUDGET = 256


class VariantUnavailable(DeskfleetError):
    """A variant cannot be started in this tree (a module it needs is missing): the benchmark
    records the reason and runs the others."""


class RoundError(DeskfleetError):
    """A round did not complete as asked (a user got fewer tokens, a request was dropped, a timeout)."""


@dataclass(frozen=True)
class Setup:
    """What every variant is built from: the exports, threads and the most users any round has."""

    one_stage: Path  # the 1-stage export (the local variants)
    two_stage: Path  # the 2-stage export (the rings)
    threads: int  # inference threads per stage
    reference_threads: int
    max_users: int
    reference_dir: Path | None  # a single IR of the whole model that openvino_genai loads


@dataclass(frozen=True)
class UserRun:
    """One user's request as the user saw it (perf_counter seconds from the round's start)."""

    ttft_s: float
    last_s: float
    tokens: tuple[int, ...]

    @property
    def decode_s(self) -> float:
        return self.last_s - self.ttft_s

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first one over the time after the first one (0 if there is no window)."""
        return (len(self.tokens) - 1) / self.decode_s if len(self.tokens) > 1 and self.decode_s > 0 else 0.0


# one round: (prompts, new tokens) -> every user's run
RoundRunner = Callable[[Sequence[Sequence[int]], int], Awaitable[list[UserRun]]]
GeneratorFactory = Callable[[Setup], AbstractAsyncContextManager[Generator]]


# -- driving a Generator -----------------------------------------------------------------------


async def generator_round(generator: Generator, prompts: Sequence[Sequence[int]], new_tokens: int,
                          timeout_s: float) -> list[UserRun]:
    """Every prompt as one user, all submitted at once; greedy, EOS ignored."""
    from engine.generation.request import GenerationRequest

    start = time.perf_counter()

    async def user(ids: Sequence[int]) -> UserRun:
        first: float | None = None
        last = 0.0
        tokens: list[int] = []
        async for event in generator.stream(GenerationRequest(tuple(ids), new_tokens, ignore_eos=True)):
            last = time.perf_counter() - start
            first = last if first is None else first
            tokens.append(event.token_id)
        if first is None:
            raise RoundError("a user's stream ended without a token")
        return UserRun(first, last, tuple(tokens))

    try:
        return list(await asyncio.wait_for(asyncio.gather(*(user(p) for p in prompts)), timeout_s))
    except TimeoutError:
        raise RoundError(f"{len(prompts)} users did not finish {new_tokens} tokens within {timeout_s:.0f} s") from None


# -- the variants that generate through Deskfleet -----------------------------------------------


def _import_paged(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise VariantUnavailable(f"the paged coordinator is not in this tree yet ({module} does not import: "
                                 f"{exc})") from None


def _paged_settings(setup: Setup) -> dict[str, Any]:
    """The paged scheduler's settings (``engine.paged.coordinator.paged_scheduler``)."""
    return {"slots": setup.max_users, "prefix_cache": False, "token_budget": TOKEN_BUDGET,
            "prefill_chunk": TOKEN_BUDGET}


@contextlib.asynccontextmanager
async def paged_local(setup: Setup) -> AsyncIterator[Generator]:
    """The paged coordinator (issue 14), its one stage in this process (``BatchCoordinator.local``)."""
    module = _import_paged("engine.paged.coordinator")
    local = getattr(module.BatchCoordinator, "local", None)
    if local is None:
        raise VariantUnavailable("the paged coordinator cannot be built here yet: engine.coordinator."
                                 "batch_coordinator.BatchCoordinator has no local()")
    coordinator = local(setup.one_stage, num_threads=setup.threads, **_paged_settings(setup))
    async with coordinator:
        yield coordinator


@contextlib.asynccontextmanager
async def paged_ring(setup: Setup) -> AsyncIterator[Generator]:
    """The paged coordinator over a paged worker process per stage on loopback
    (``engine.tools.local_fleet.paged_local_fleet``)."""
    _import_paged("engine.paged.coordinator")
    _import_paged("engine.paged.ring_path")
    fleet = _import_paged("engine.tools.local_fleet")
    if not hasattr(fleet, "paged_local_fleet"):
        raise VariantUnavailable("the paged ring cannot be started here yet: engine.tools.local_fleet has no "
                                 "paged_local_fleet()")
    async with fleet.paged_local_fleet(setup.two_stage, threads=setup.threads, **_paged_settings(setup)) as c:
        yield c


GENERATORS: dict[str, GeneratorFactory] = {
    "paged-local": paged_local,
    "paged-ring": paged_ring,
}
STAGES = {"paged-local": 1, "paged-ring": 2}


# -- the reference ------------------------------------------------------------------------------


class ReferenceServer:
    """``openvino_genai.ContinuousBatchingPipeline`` on one IR of the whole model, like for like:
    f16 KV cache, the given inference threads, prefix caching off, greedy, EOS ignored, the same
    token budget per step (``max_num_batched_tokens``) and chunked prefill (``dynamic_split_fuse``)."""

    def __init__(self, model_dir: Path, threads: int, max_users: int) -> None:
        import openvino_genai as genai

        scheduler = genai.SchedulerConfig()  # 2026.4.1: no keyword constructor
        scheduler.enable_prefix_caching = False
        scheduler.max_num_seqs = max(max_users, 1)
        scheduler.max_num_batched_tokens = TOKEN_BUDGET
        scheduler.dynamic_split_fuse = True
        self.scheduler = {"enable_prefix_caching": False, "max_num_seqs": scheduler.max_num_seqs,
                          "max_num_batched_tokens": TOKEN_BUDGET, "dynamic_split_fuse": True}
        self.properties = {"KV_CACHE_PRECISION": "f16", "INFERENCE_NUM_THREADS": threads}
        self._pipe = genai.ContinuousBatchingPipeline(str(model_dir), scheduler, "CPU", self.properties)
        self._ids = itertools.count(1)

    def run_round(self, prompts: Sequence[Sequence[int]], new_tokens: int, timeout_s: float) -> list[UserRun]:
        """Every prompt added at once, then ``step()`` until all finish; each request's new
        tokens are read after every step (a token's time is the end of the step that made it)."""
        import numpy as np
        import openvino as ov
        import openvino_genai as genai

        config = genai.GenerationConfig()
        config.max_new_tokens = new_tokens
        config.ignore_eos = True
        config.do_sample = False
        config.num_beams = 1
        start = time.perf_counter()
        handles = [self._pipe.add_request(next(self._ids), ov.Tensor(np.asarray([list(p)], dtype=np.int64)), config)
                   for p in prompts]
        tokens: list[list[int]] = [[] for _ in prompts]
        first: list[float | None] = [None] * len(prompts)
        last = [0.0] * len(prompts)
        while True:
            busy = self._pipe.has_non_finished_requests()
            if busy:
                self._pipe.step()
            now = time.perf_counter() - start
            for i, handle in enumerate(handles):
                if handle.can_read():
                    for out in handle.read().values():
                        if len(out.generated_ids):
                            tokens[i] += [int(t) for t in out.generated_ids]
                            first[i] = now if first[i] is None else first[i]
                            last[i] = now
            if not busy:
                break
            if now > timeout_s:
                for handle in handles:
                    handle.cancel()
                raise RoundError(f"the reference did not finish {len(prompts)} users within {timeout_s:.0f} s")
        finished = genai.GenerationStatus.FINISHED
        bad = [str(h.get_status()) for h in handles if h.get_status() != finished]
        if bad:
            raise RoundError(f"the reference did not finish every request: {bad}")
        runs = []
        for f, la, t in zip(first, last, tokens, strict=True):
            if f is None:
                raise RoundError("a reference request finished without a token")
            runs.append(UserRun(f, la, tuple(t)))
        return runs


def reference_round_runner(server: ReferenceServer, timeout_s: float) -> RoundRunner:
    """The reference's round, off the event loop (the other variants' loops stay responsive)."""

    async def run(prompts: Sequence[Sequence[int]], new_tokens: int) -> list[UserRun]:
        return await asyncio.to_thread(server.run_round, prompts, new_tokens, timeout_s)

    return run


def generator_round_runner(generator: Generator, timeout_s: float) -> RoundRunner:
    async def run(prompts: Sequence[Sequence[int]], new_tokens: int) -> list[UserRun]:
        return await generator_round(generator, prompts, new_tokens, timeout_s)

    return run
