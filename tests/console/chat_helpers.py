"""The fleet's real OpenAI-compatible API (engine/api/server.py, on loopback in a thread) over a
real Router, for the chat window's tests and screenshots: canned generators answer Markdown, two
models are served when asked, and a ring can report itself paused the way a coordinator does
after an agent paused (its /health detail, and the 503 a request then gets)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

from engine.generation.generator import UnavailableError
from engine.generation.request import GenerationRequest, TokenEvent
from engine.generation.ring_report import RingReport, RingStatus
from engine.generation.router import Router
from tests.support.canned_api import CannedGenerator, served

MARKDOWN_ANSWER = """Here is a **quick** way to count words in Python:

```python
def count_words(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return counts
```

What it does:

1. lowercases the text, so *The* and *the* count once;
2. splits at whitespace;
3. counts with `dict.get`.

| Input | Result |
|:------|-------:|
| `"a b a"` | `{'a': 2, 'b': 1}` |
| `""` | `{}` |

> Tip: `collections.Counter` does the same in one line.
"""
MARKDOWN_CODE = MARKDOWN_ANSWER.split("```python\n")[1].split("\n```")[0]
# worded as the service's failover plan words it (console/fleet/failover_plan.py; the real one is
# in tests/console/test_chat_real_fleet.py)
PAUSE_DETAIL = "stage 1 on pc-b is paused (the keyboard is in use); no standby agent is free to take it"


class SlowGenerator(CannedGenerator):
    """Answers like CannedGenerator, one token per ``delay`` seconds (long enough to stop it)."""

    def __init__(self, answer: str | Callable[[GenerationRequest, int], str], delay: float = 0.02):
        super().__init__(answer)
        self.delay = delay

    async def _stream(self, request: GenerationRequest, index: int) -> AsyncIterator[TokenEvent]:
        async for event in super()._stream(request, index):
            await asyncio.sleep(self.delay)
            yield event


class PausedGenerator(CannedGenerator):
    """A ring whose agent paused with no spare free: /health says why; a request gets 503 naming it."""

    def __init__(self, detail: str = PAUSE_DETAIL):
        super().__init__("never")
        self.detail = detail

    def ring_reports(self) -> tuple[RingReport, ...]:
        return (RingReport("default", self.model.name, RingStatus.DOWN, self.detail, 1),)

    async def _stream(self, request: GenerationRequest, index: int) -> AsyncIterator[TokenEvent]:
        raise UnavailableError(f"the ring cannot serve now: {self.detail}")
        yield  # an async generator


@contextlib.contextmanager
def chat_api(tokenizer=None, **models: CannedGenerator) -> Iterator[str]:
    """The real API over a Router serving each ``name=generator`` as model ``name`` (none: a fleet
    with no ring yet), with ``tokenizer`` (default a ByteTokenizer); yields its /v1 URL."""
    router = Router()
    for name, generator in models.items():
        router.add_ring(f"ring-{name}", generator, model_name=name)
    with served(router, tokenizer=tokenizer) as url:
        yield url
