"""The API's own metrics and the ``/metrics`` exposition, through ``prometheus_client``.

:class:`ApiMetrics` owns one :class:`~prometheus_client.CollectorRegistry` per server (never the
process-global one: several servers run in one test process, and a fleet service's registry also
holds the fleet's figures). It counts what the HTTP layer sees (requests by status, tokens by
model, time to first token and time per output token by model, tokens by key) and registers a
:class:`DictCollector` over the generator's ``metrics()``.

A generator's metrics stay a flat ``{name: float}`` mapping (the console and the tests read them
by name); :func:`families` turns one into metric families:

- a key may carry labels: ``stage_compute_ms_per_step{stage="1"}``;
- names ending in ``_total`` are counters, everything else a gauge;
- ``X_bucket{...,le="b"}`` with ``X_sum`` and ``X_count`` form the histogram ``X`` (its bounds
  in base units: seconds, bytes);
- a name with a millisecond token (``_ms_``) is exposed in seconds (``_seconds_``, value / 1000):
  Prometheus wants base units, and promtool refuses abbreviated ones.

Label cardinality is bounded: models and rings are the service's own, stages a ring's, and the
per-key usage counter names at most :data:`MAX_KEY_LABELS` keys (later keys count under ``other``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

PREFIX = "deskfleet_"
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)  # seconds per output token
MAX_KEY_LABELS = 500  # distinct API keys named on the usage counter; the rest count as OTHER_KEY
OTHER_KEY = "other"
CONTENT_TYPE = CONTENT_TYPE_LATEST
GENERATOR_HELP = "reported by the generator"

_KEY = re.compile(r"^([^{]*)(?:\{(.*)\})?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
_MS = re.compile(r"(^|_)ms(_|$)")


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition (0.0.4) of ``registry``."""
    return generate_latest(registry)


class ApiMetrics:
    """The API's own metrics, in the server's own registry (:attr:`registry`); ``active`` is read
    by the door (admission) and ``/health`` as a plain int."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.active = 0
        r = self.registry
        self._requests = Counter(f"{PREFIX}api_requests", "HTTP requests answered, by status code", ["code"],
                                 registry=r)
        Gauge(f"{PREFIX}api_active_requests", "generation requests in flight",
              registry=r).set_function(lambda: self.active)
        self._prompt = Counter(f"{PREFIX}api_prompt_tokens", "prompt tokens admitted, by model", ["model"],
                               registry=r)
        self._completion = Counter(f"{PREFIX}api_completion_tokens", "tokens generated, by model", ["model"],
                                   registry=r)
        self._generation = Counter(f"{PREFIX}api_generation_seconds",
                                   "first to last token, summed over requests, by model", ["model"], registry=r)
        self._decode = Gauge(f"{PREFIX}api_decode_tokens_per_second", "decode speed of the last request",
                             registry=r)
        self._ttft = Histogram(f"{PREFIX}api_ttft_seconds", "time to first token, by model", ["model"],
                               buckets=TTFT_BUCKETS, registry=r)
        self._tpot = Histogram(f"{PREFIX}api_time_per_output_token_seconds",
                               "first to last token over the tokens after the first, by model", ["model"],
                               buckets=TPOT_BUCKETS, registry=r)
        self._key_tokens = Counter(f"{PREFIX}api_key_tokens", "tokens by API key (person or application), "
                                   "model and kind (prompt, completion)", ["key", "model", "kind"], registry=r)
        self._keys: set[str] = set()
        self._generator: Collector | None = None

    def use_generator(self, collector: Collector | None) -> None:
        """Expose ``collector`` as the generator's metrics (replacing the one before; None: none)."""
        if self._generator is not None:
            self.registry.unregister(self._generator)
        self._generator = collector
        if collector is not None:
            self.registry.register(collector)

    def count(self, status: int) -> None:
        """Count one answered request by its HTTP status."""
        self._requests.labels(str(status)).inc()

    def _key(self, key: str) -> str:
        if key in self._keys or len(self._keys) < MAX_KEY_LABELS:
            self._keys.add(key)
            return key
        return OTHER_KEY

    def observe_prompt(self, tokens: int, model: str = "", key: str = "") -> None:
        """Count one request's admitted prompt tokens."""
        self._prompt.labels(model).inc(tokens)
        self._key_tokens.labels(self._key(key), model, "prompt").inc(tokens)

    def observe_ttft(self, seconds: float, model: str = "") -> None:
        """Record one request's time to first token."""
        self._ttft.labels(model).observe(seconds)

    def observe_generation(self, tokens: int, decode_seconds: float, model: str = "", key: str = "") -> None:
        """Record one finished generation: its token count and first-to-last-token time."""
        self._completion.labels(model).inc(tokens)
        self._generation.labels(model).inc(max(0.0, decode_seconds))
        self._key_tokens.labels(self._key(key), model, "completion").inc(tokens)
        if tokens > 1 and decode_seconds > 0:
            self._decode.set((tokens - 1) / decode_seconds)
            self._tpot.labels(model).observe(decode_seconds / (tokens - 1))


# -- a generator's {name: value} as metric families ---------------------------------------------------

def split_key(key: str) -> tuple[str, dict[str, str]]:
    """``'name{a="1",b="2"}'`` -> ``("name", {"a": "1", "b": "2"})``; a key that does not parse
    keeps its whole text as the (later sanitised) name."""
    m = _KEY.match(key)
    if m is None:
        return key, {}
    base, inner = m.groups()
    if not inner:
        return base, {}
    labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(inner)}
    return (base, labels) if _LABEL.sub("", inner).strip() == "" else (key, {})


def _base_units(name: str, value: float) -> tuple[str, float]:
    """Milliseconds to seconds: ``stage_compute_ms_per_step`` -> ``stage_compute_seconds_per_step``."""
    if _MS.search(name):
        return _MS.sub(r"\1seconds\2", name), value / 1000.0
    return name, value


def exposed_name(name: str) -> str:
    """The family name a generator metric ``name`` is exposed under (with the prefix)."""
    base, _ = split_key(name)
    return PREFIX + _base_units(re.sub(r"[^a-zA-Z0-9_:]", "_", base), 0.0)[0]


def families(metrics: Mapping[str, float], labels: Mapping[str, str] | None = None,
             help_text: str | Callable[[str], str] = GENERATOR_HELP) -> list[Metric]:
    """The metric families of a generator's ``metrics`` (see the module's docstring), each sample
    with ``labels`` added (they win over a key's own labels of the same name)."""
    extra = dict(labels or {})
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for key, value in sorted(metrics.items()):
        base, own = split_key(key)
        name, v = _base_units(re.sub(r"[^a-zA-Z0-9_:]", "_", base), float(value))
        if name.endswith(("_bucket", "_count")):
            v = float(value)  # counts, whatever the unit (a histogram's bounds are given in base units)
        samples.setdefault(name, []).append(({**own, **extra}, v))
    histograms = {n.removesuffix("_bucket") for n, s in samples.items()
                  if n.endswith("_bucket") and all("le" in lab for lab, _ in s)}
    out: list[Metric] = []
    for name, found in samples.items():
        hist = next((h for h in histograms if name in (f"{h}_bucket", f"{h}_sum", f"{h}_count")), None)
        if hist is not None and name != f"{hist}_bucket":
            continue  # its _sum and _count go with its buckets
        doc = help_text(name) if callable(help_text) else help_text
        if hist is not None:
            family = Metric(PREFIX + hist, doc, "histogram")
            for part in ("_bucket", "_count", "_sum"):
                for lab, v in samples.get(hist + part, ()):
                    family.add_sample(PREFIX + hist + part, lab, v)
        elif name.endswith("_total"):
            family = Metric(PREFIX + name.removesuffix("_total"), doc, "counter")
            for lab, v in found:
                family.add_sample(PREFIX + name, lab, v)
        else:
            family = Metric(PREFIX + name, doc, "gauge")
            for lab, v in found:
                family.add_sample(PREFIX + name, lab, v)
        out.append(family)
    return out


def merge(groups: list[list[Metric]]) -> Iterator[Metric]:
    """One family per name from several ``families()`` results (one per ring, say): their samples
    joined under the first one's help and type."""
    by_name: dict[str, Metric] = {}
    for group in groups:
        for family in group:
            have = by_name.get(family.name)
            if have is None:
                by_name[family.name] = have = Metric(family.name, family.documentation, family.type)
            if have.type != family.type:
                continue  # a name two generators disagree on: the first one's kind stands
            have.samples.extend(family.samples)
    yield from by_name.values()


class DictCollector:
    """A registry collector over ``source()`` (a generator's ``metrics()``), read at every scrape."""

    def __init__(self, source: Callable[[], Mapping[str, float]], labels: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.labels = dict(labels or {})

    def collect(self) -> Iterator[Metric]:
        yield from families(self.source(), self.labels)

    def describe(self) -> list[Any]:
        return []  # names vary with the generator: not checked at registration
