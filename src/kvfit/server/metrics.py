"""Prometheus metrics, one CollectorRegistry per app (no global state).

Gauges and counters of the cache and the scheduler are read from the engine's stats snapshot at
scrape time, so a scrape never touches the engine; latency histograms are observed on the event
loop as outputs arrive and requests finish.

Every figure is there twice: under kvfit's names and under vLLM's (`vllm:*`, labels model_name
and engine, vLLM's buckets), so dashboards built for vLLM work. vllm:prefix_cache_queries/hits
are exact counters, so an open /metrics leaves them out (see guards.public_prefix_cache_hit_rate):
they appear with --metrics-require-key.
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
# vLLM's buckets (vllm/v1/metrics/loggers.py)
VLLM_TTFT_BUCKETS = TTFT_BUCKETS + (160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"                         # one engine per server (vLLM labels each data-parallel engine)


def kv_cache_usage(stats: dict) -> float:
    """Share of the KV cache's blocks in a block table (vLLM's kv_cache_usage_perc: 1 = full)."""
    return stats["kv_blocks_used"] / stats["kv_blocks_total"] if stats["kv_blocks_total"] else 0.0


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(buckets)
            buckets.append(m * scale)
        scale *= 10


class _EngineCollector:
    """Turns one stats dict (LLMEngine.stats()) into the cache and scheduler metrics."""

    def __init__(self, stats: Callable[[], dict], model_name: str, exact_prefix_cache: bool = False):
        self._stats = stats
        self._labels = [model_name, ENGINE_INDEX]
        # an open /metrics shows only a coarse hit rate: exact counters could confirm another user's prompt
        self._exact_prefix_cache = exact_prefix_cache

    def collect(self):
        s = self._stats()
        yield from self._kvfit(s)
        yield from self._vllm(s)

    def _kvfit(self, s: dict):
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
        if s.get("device_headroom_bytes") is not None:     # platforms that report free device memory
            yield GaugeMetricFamily("kvfit:device_headroom_bytes", "free device memory at the last check; under "
                                    "the low mark new requests wait while others run (engine/headroom.py)",
                                    value=s["device_headroom_bytes"])
            yield GaugeMetricFamily("kvfit:admission_paused", "1 while low device headroom holds new requests back",
                                    value=float(bool(s.get("admission_paused"))))
        if s.get("allocator_cache_releases") is not None:
            yield CounterMetricFamily("kvfit:allocator_cache_releases", "times the allocator's cached blocks went "
                                      "back to the device to keep the process inside its memory budget (each a "
                                      "device sync; frequent ones cost throughput)",
                                      value=s["allocator_cache_releases"])
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

    def _vllm(self, s: dict):
        def family(kind, name, documentation, value):
            metric = kind(name, documentation, labels=VLLM_LABELS)
            metric.add_metric(self._labels, value)
            return metric

        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in model execution "
                     "batches.", s["running"])
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                     s["waiting"])
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                     kv_cache_usage(s))
        yield family(CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemption from the "
                     "engine.", s["preemptions"])
        if self._exact_prefix_cache:
            yield family(CounterMetricFamily, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of "
                         "number of queried tokens.", s["prefix_cache_queries"])
            yield family(CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number "
                         "of cached tokens.", s["prefix_cache_hits"])


# vLLM's FinishReason strings (v1/engine/__init__.py), each a vllm:request_success_total series from start-up
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


class ServerMetrics:
    """The app's registry: engine gauges plus request latency histograms and token counters.

    progress() runs on each output a request gets (tokens counted as they are made, as vLLM does);
    observe() once per ended request."""

    def __init__(self, stats: Callable[[], dict], exact_prefix_cache: bool = False, model_name: str = "kvfit",
                 max_model_len: int = 1 << 20):
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(stats, model_name, exact_prefix_cache))
        self.ttft = Histogram("kvfit_time_to_first_token_seconds", "arrival to the first output token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("kvfit_time_per_output_token_seconds", "per request: (last token - first "
                              "token) / (output tokens - 1)", buckets=TPOT_BUCKETS, registry=r)
        self.finished = Counter("kvfit_requests_finished", "requests that ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("kvfit_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kvfit_generation_tokens", "tokens generated for finished requests",
                                         registry=r)
        labels = (model_name, ENGINE_INDEX)

        def vllm(kind, name, documentation, **kwargs):
            return kind(name, documentation, VLLM_LABELS, registry=r, **kwargs).labels(*labels)

        self.vllm_prompt_tokens = vllm(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.vllm_generation_tokens = vllm(Counter, "vllm:generation_tokens", "Number of generation tokens "
                                           "processed.")
        self.vllm_ttft = vllm(Histogram, "vllm:time_to_first_token_seconds", "Histogram of time to first token "
                              "in seconds.", buckets=VLLM_TTFT_BUCKETS)
        self.vllm_itl = vllm(Histogram, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency "
                             "in seconds.", buckets=VLLM_ITL_BUCKETS)
        self.vllm_tpot = vllm(Histogram, "vllm:request_time_per_output_token_seconds", "Histogram of "
                              "time_per_output_token_seconds per request.", buckets=VLLM_ITL_BUCKETS)
        self.vllm_e2e = vllm(Histogram, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency "
                             "in seconds.", buckets=VLLM_LATENCY_BUCKETS)
        # the engine's own phases of a finished request (RequestOutput.metrics), as vLLM's: waiting before its
        # first step, first step to first token, first token to the end, first step to the end
        self.vllm_phases = {phase: vllm(Histogram, f"vllm:request_{phase}_time_seconds", documentation,
                                        buckets=VLLM_LATENCY_BUCKETS)
                            for phase, documentation in (
                                ("queue", "Histogram of time spent in WAITING phase for request."),
                                ("prefill", "Histogram of time spent in PREFILL phase for request."),
                                ("decode", "Histogram of time spent in DECODE phase for request."),
                                ("inference", "Histogram of time spent in RUNNING phase for request."))}
        token_buckets = one_two_five_buckets(max_model_len)
        self.vllm_request_prompt_tokens = vllm(Histogram, "vllm:request_prompt_tokens", "Number of prefill "
                                               "tokens processed.", buckets=token_buckets)
        self.vllm_request_generation_tokens = vllm(Histogram, "vllm:request_generation_tokens", "Number of "
                                                   "generation tokens processed.", buckets=token_buckets)
        self._vllm_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                     VLLM_LABELS + ("finished_reason",), registry=r)
        for reason in VLLM_FINISH_REASONS:          # every label from the start, at 0, as vLLM creates them
            self._vllm_success.labels(*labels, reason)
        self._labels = labels
        # totals since start, for the periodic stats line (counters read back would need the registry)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def progress(self, num_new_prompt_tokens: int, num_new_tokens: int, ttft: float | None,
                 itl: float | None) -> None:
        """Record one output of a request: tokens it added; its first token's latency or the time
        since its previous output (vLLM observes one inter-token latency per step of a request)."""
        if num_new_prompt_tokens:
            self.vllm_prompt_tokens.inc(num_new_prompt_tokens)
            self.num_prompt_tokens += num_new_prompt_tokens
        if num_new_tokens:
            self.vllm_generation_tokens.inc(num_new_tokens)
            self.num_generation_tokens += num_new_tokens
        if ttft is not None:
            self.vllm_ttft.observe(ttft)
        if itl is not None:
            self.vllm_itl.observe(itl)

    def observe(self, stream, num_output_tokens: int, reason: str, end_time: float | None = None) -> None:
        """Record one ended request (stream: an async_engine.RequestStream)."""
        metrics = getattr(stream.output, "metrics", None)       # None: no output, or a stand-in engine's
        phases = metrics.phases() if metrics is not None else None
        for phase, seconds in (phases or {}).items():
            self.vllm_phases[phase].observe(seconds)
        self.finished.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(stream.num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        if reason in ("stop", "length", "abort", "error"):
            self._vllm_success.labels(*self._labels, reason).inc()
        if end_time is not None:
            self.vllm_e2e.observe(end_time - stream.arrival_time)
        if stream.first_token_time is None:
            return
        self.vllm_request_prompt_tokens.observe(stream.num_prompt_tokens)
        self.vllm_request_generation_tokens.observe(num_output_tokens)
        self.ttft.observe(stream.first_token_time - stream.arrival_time)
        if num_output_tokens > 1:
            tpot = (stream.last_token_time - stream.first_token_time) / (num_output_tokens - 1)
            self.tpot.observe(tpot)
            self.vllm_tpot.observe(tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)
