"""The API's own counters and the Prometheus text of ``/metrics`` (pure): :class:`ApiMetrics`
counts what the HTTP layer sees (requests by status, tokens, time to first token), and
:func:`render_prometheus` writes them next to the generator's own metrics, prefixed ``deskfleet_``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class ApiMetrics:
    """The API's own counters, rendered next to the generator's on /metrics."""

    requests: dict[int, int] = field(default_factory=dict)  # by HTTP status
    active: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    generation_seconds: float = 0.0  # first token to last, summed over requests
    last_decode_tok_per_s: float = 0.0
    ttft_counts: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    ttft_sum: float = 0.0

    def count(self, status: int) -> None:
        """Count one answered request by its HTTP status."""
        self.requests[status] = self.requests.get(status, 0) + 1

    def observe_ttft(self, seconds: float) -> None:
        """Record one request's time to first token."""
        self.ttft_counts[next((i for i, b in enumerate(TTFT_BUCKETS) if seconds <= b), len(TTFT_BUCKETS))] += 1
        self.ttft_sum += seconds

    def observe_generation(self, tokens: int, decode_seconds: float) -> None:
        """Record one finished generation: its token count and first-to-last-token time."""
        self.completion_tokens += tokens
        self.generation_seconds += decode_seconds
        if tokens > 1 and decode_seconds > 0:
            self.last_decode_tok_per_s = (tokens - 1) / decode_seconds


# ApiMetrics attribute -> (metric name, type, help)
API_SCALARS = {
    "active": ("api_active_requests", "gauge", "generation requests in flight"),
    "prompt_tokens": ("api_prompt_tokens_total", "counter", "prompt tokens admitted"),
    "completion_tokens": ("api_completion_tokens_total", "counter", "tokens generated"),
    "generation_seconds": ("api_generation_seconds_total", "counter", "first to last token, summed over requests"),
    "last_decode_tok_per_s": ("api_decode_tokens_per_second", "gauge", "decode speed of the last request"),
}
_METRIC_KEY = re.compile(r"^([^{]*)(\{.*\})?$")


def _value(v: float) -> str:
    if math.isnan(v) or math.isinf(v):
        return "NaN" if math.isnan(v) else "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if float(v).is_integer() and abs(v) < 1 << 53 else repr(float(v))


def _family(lines: list[str], name: str, kind: str, help_text: str, samples: Sequence[tuple[str, float]]) -> None:
    """One metric family; a sample's "labels" may start with a suffix (``_bucket{le="1"}``)."""
    lines += [f"# HELP deskfleet_{name} {help_text}", f"# TYPE deskfleet_{name} {kind}"]
    lines += [f"deskfleet_{name}{labels} {_value(v)}" for labels, v in samples]


def render_prometheus(generator_metrics: Mapping[str, float], api: ApiMetrics) -> str:
    """Prometheus text exposition (0.0.4) of the generator's metrics and the API's, prefixed ``deskfleet_``.

    A generator key may carry labels (``stage_seconds_total{stage="1"}``); names ending in
    ``_total`` are counters, everything else a gauge.
    """
    lines: list[str] = []
    grouped: dict[str, list[tuple[str, float]]] = {}
    for key, v in sorted(generator_metrics.items()):
        m = _METRIC_KEY.match(key)  # no match: an unbalanced "{", kept in the (sanitised) name
        base, labels = m.groups() if m else (key, None)
        grouped.setdefault(re.sub(r"[^a-zA-Z0-9_:]", "_", base), []).append((labels or "", float(v)))
    for name, samples in grouped.items():
        _family(lines, name, "counter" if name.endswith("_total") else "gauge", "reported by the generator", samples)
    _family(lines, "api_requests_total", "counter", "HTTP requests answered, by status code",
            [(f'{{code="{code}"}}', n) for code, n in sorted(api.requests.items())])
    for attr, (name, kind, help_text) in API_SCALARS.items():
        _family(lines, name, kind, help_text, [("", getattr(api, attr))])
    bounds = (*map(str, TTFT_BUCKETS), "+Inf")
    cumulative = [sum(api.ttft_counts[: i + 1]) for i in range(len(bounds))]
    _family(lines, "api_ttft_seconds", "histogram", "time to first token",
            [*((f'_bucket{{le="{b}"}}', n) for b, n in zip(bounds, cumulative, strict=True)),
             ("_sum", api.ttft_sum), ("_count", cumulative[-1])])
    return "\n".join(lines) + "\n"
