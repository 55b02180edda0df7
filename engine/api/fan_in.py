"""Several async generators read as one: how the API runs the ``n`` choices of a request at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any


async def merged(streams: Sequence[AsyncGenerator[Any, None]]) -> AsyncGenerator[Any, None]:
    """The items of several async generators as they come (one: itself, no task). The first error
    of any ends all of them; closing this one closes every stream (which cancels its generation)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncGenerator[Any, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait((item, None))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((done, exc))
        else:
            queue.put_nowait((done, None))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
