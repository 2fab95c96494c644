"""Prometheus metrics, one CollectorRegistry per app (no global state).

Gauges and counters of the cache and the scheduler are read from the engine's stats snapshot at
scrape time, so a scrape never touches the engine; latency histograms are observed as requests
finish on the event loop.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvfit.server.guards import public_prefix_cache_hit_rate

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0)


class _EngineCollector:
    """Turns one stats dict (LLMEngine.stats()) into the cache and scheduler metrics."""

    def __init__(self, stats: Callable[[], dict], exact_prefix_cache: bool = False):
        self._stats = stats
        # an open /metrics shows only a coarse hit rate: exact counters could confirm another user's prompt
        self._exact_prefix_cache = exact_prefix_cache

    def collect(self):
        s = self._stats()
        yield GaugeMetricFamily("kvfit_kv_blocks_total", "KV cache blocks allocated at start-up",
                                value=s["kv_blocks_total"])
        blocks = GaugeMetricFamily("kvfit_kv_blocks", "KV cache blocks by state: free, used (in a block "
                                   "table) or cached (free, holding a reusable prefix)", labels=["state"])
        for state in ("free", "used", "cached"):
            blocks.add_metric([state], s[f"kv_blocks_{state}"])
        yield blocks
        yield GaugeMetricFamily("kvfit_token_capacity", "tokens the KV cache holds (blocks x block size)",
                                value=s["token_capacity"])
        yield GaugeMetricFamily("kvfit_requests_running", "requests in the running batch", value=s["running"])
        yield GaugeMetricFamily("kvfit_requests_waiting", "requests waiting for blocks or a batch slot "
                                "(preempted ones included)", value=s["waiting"])
        yield CounterMetricFamily("kvfit_preemptions", "running requests preempted (recomputed later) "
                                  "because no block was free", value=s["preemptions"])
        queries, hits = s["prefix_cache_queries"], s["prefix_cache_hits"]
        if not self._exact_prefix_cache:
            yield GaugeMetricFamily("kvfit_prefix_cache_hit_rate", "share of prompt tokens found in the prefix "
                                    "cache, rounded to 0.1, 0 until 100000 prompt tokens were looked up (exact "
                                    "counters with --metrics-require-key)",
                                    value=public_prefix_cache_hit_rate(hits, queries))
            return
        yield GaugeMetricFamily("kvfit_prefix_cache_hit_rate", "share of prompt tokens found in the prefix "
                                "cache since start-up", value=hits / queries if queries else 0.0)
        yield CounterMetricFamily("kvfit_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                  value=queries)
        yield CounterMetricFamily("kvfit_prefix_cache_hits", "prompt tokens found in the prefix cache",
                                  value=hits)


class ServerMetrics:
    """The app's registry: engine gauges plus request latency histograms and token counters."""

    def __init__(self, stats: Callable[[], dict], exact_prefix_cache: bool = False):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, exact_prefix_cache))
        self.ttft = Histogram("kvfit_time_to_first_token_seconds", "arrival to the first output token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("kvfit_time_per_output_token_seconds", "per request: (last token - first "
                              "token) / (output tokens - 1)", buckets=TPOT_BUCKETS, registry=self.registry)
        self.finished = Counter("kvfit_requests_finished", "requests that ended, by finish reason",
                                ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("kvfit_prompt_tokens", "prompt tokens of finished requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("kvfit_generation_tokens", "tokens generated for finished requests",
                                         registry=self.registry)

    def observe(self, stream, num_output_tokens: int, reason: str) -> None:
        """Record one ended request (stream: an async_engine.RequestStream)."""
        self.finished.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(stream.num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        if stream.first_token_time is None:
            return
        self.ttft.observe(stream.first_token_time - stream.arrival_time)
        if num_output_tokens > 1:
            self.tpot.observe((stream.last_token_time - stream.first_token_time) / (num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
