"""The API's door: what a request must pass on its caller alone, before its body is read.

The route's middleware (``engine.api.server``) checks the ``Host`` and content type
(:mod:`engine.api.guard`) and the key (:mod:`engine.api.keys`); then, for a completion, a
:class:`Door` takes the key's rate limit (429 with ``Retry-After``) and a slot of the server's
``max_concurrent`` (429). A key over its rate, or a full server, costs no reading and no parsing;
a request that passes holds its slot until its answer ends, tokenising included. Below the
request's stages (parse → admit → generate → shape): it knows nothing of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from engine.api.api_error import ApiError
from engine.api.api_metrics import ApiMetrics
from engine.api.keys import Caller, RateLimiter, retry_after_header


class Door:
    """The checks that need only the caller, made before the body is read: the key's rate limit,
    then a slot of the server's ``max_concurrent`` (counted in ``metrics.active`` while held)."""

    def __init__(self, limiter: RateLimiter, metrics: ApiMetrics, max_concurrent: int, retry_after_s: int) -> None:
        self.limiter = limiter
        self.metrics = metrics
        self.max_concurrent = max_concurrent
        self.retry_after_s = retry_after_s

    @contextlib.contextmanager
    def enter(self, caller: Caller) -> Iterator[None]:
        """Hold a slot for ``caller``'s request; ApiError 429 over its rate limit or with every slot taken."""
        wait = self.limiter.admit(caller)
        if wait is not None:
            limits = ", ".join(f"{n} {what}/min" for n, what in ((caller.rpm, "requests"), (caller.tpm, "tokens"))
                               if n is not None)
            raise ApiError(429, f"the key {caller.name!r} is over its rate limit ({limits}); retry in "
                           f"{retry_after_header(wait)} s", "rate_limit_exceeded",
                           headers={"Retry-After": retry_after_header(wait)})
        if self.metrics.active >= self.max_concurrent:
            raise ApiError(429, f"the server is handling {self.metrics.active} requests, its limit; retry "
                           f"in {self.retry_after_s} s", "too_many_requests")
        self.metrics.active += 1  # admitted: counts from here, so tokenising requests hold a slot
        try:
            yield
        finally:
            self.metrics.active -= 1
