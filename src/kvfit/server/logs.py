"""What `kvfit serve` logs: one format for kvfit's loggers and uvicorn's, an access line per request,
and a periodic stats line (as vLLM's: every 10 s, only while there is activity).

Access line (logger kvfit.access, INFO):
  127.0.0.1:50312 "POST /v1/completions" 200 0.412s prompt_tokens=7 output_tokens=16
Stats line (logger kvfit.stats, INFO):
  Avg prompt throughput: 95.2 tokens/s, Avg generation throughput: 310.0 tokens/s, Running: 3 reqs,
  Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass
from typing import Callable

from kvfit.server.metrics import ServerMetrics, kv_cache_usage

LOG_FORMAT = "%(levelname)s %(asctime)s.%(msecs)03d [%(name)s] %(message)s"
LOG_DATE_FORMAT = "%m-%d %H:%M:%S"
STATS_INTERVAL_SECONDS = 10.0            # vLLM's
ACCESS_SCOPE_KEY = "kvfit.access"         # where a handler leaves the request's token counts

access_logger = logging.getLogger("kvfit.access")
stats_logger = logging.getLogger("kvfit.stats")


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record comes (not as it was when configured: a caller
    may redirect or close the one it had, as a test's capture does)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def configure_logging(level: str = "info") -> None:
    """Every record (kvfit's, uvicorn's: uvicorn is started with log_config=None, so its loggers
    propagate here) on stderr in LOG_FORMAT, with a timestamp. Replaces a plain stderr handler set
    up before (logging.basicConfig's), so there is one format; other handlers stay."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler) in (logging.StreamHandler, _StderrHandler):
            root.removeHandler(handler)
    root.addHandler(_StderrHandler())
    root.setLevel(level.upper())


@dataclass
class AccessRecord:
    """Token counts of one request, filled in by its handler (None: not a generation request)."""

    prompt_tokens: int | None = None
    output_tokens: int | None = None


class AccessLogMiddleware:
    """Outermost ASGI middleware: one access line per HTTP request once it has been answered (for a
    stream, once the stream ended), refusals by the guards included."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        record = scope[ACCESS_SCOPE_KEY] = AccessRecord()
        status = None

        async def tracked_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        finally:
            if access_logger.isEnabledFor(logging.INFO):
                access_logger.info("%s", access_line(scope, status, time.monotonic() - started, record))


def access_line(scope, status: int | None, duration_s: float, record: AccessRecord) -> str:
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    # the path is the client's: repr-escaped so it cannot forge a log line, and shortened
    path = scope.get("path", "")
    path = path if path.isprintable() and len(path) <= 200 else repr(path[:200])
    line = f'{who} "{scope.get("method", "-")} {path}" {status if status is not None else "-"} {duration_s:.3f}s'
    if record.prompt_tokens is not None:
        line += f" prompt_tokens={record.prompt_tokens} output_tokens={record.output_tokens or 0}"
    return line


class StatsLogger:
    """The periodic stats line: throughput since the last line, the batch, KV usage, prefix hits."""

    def __init__(self, metrics: ServerMetrics, stats: Callable[[], dict], interval_s: float = STATS_INTERVAL_SECONDS):
        self.metrics, self.stats, self.interval_s = metrics, stats, interval_s
        self._last_time = time.monotonic()
        self._last_tokens = (0, 0)
        self._last_prefix = (0, 0)
        self._was_active = False

    def line(self, now: float) -> str | None:
        """The line for the interval ending now, or None when the engine was idle during it and
        the one before (vLLM's rule, so an idle server does not log)."""
        elapsed = max(now - self._last_time, 1e-9)
        tokens = (self.metrics.num_prompt_tokens, self.metrics.num_generation_tokens)
        prompt_tps = (tokens[0] - self._last_tokens[0]) / elapsed
        generation_tps = (tokens[1] - self._last_tokens[1]) / elapsed
        s = self.stats()
        queries, hits = s["prefix_cache_queries"], s["prefix_cache_hits"]
        new_queries, new_hits = queries - self._last_prefix[0], hits - self._last_prefix[1]
        active = bool(prompt_tps or generation_tps or s["running"] or s["waiting"])
        was_active, self._was_active = self._was_active, active
        self._last_time, self._last_tokens, self._last_prefix = now, tokens, (queries, hits)
        if not (active or was_active):
            return None
        hit_rate = new_hits / new_queries if new_queries else 0.0
        return (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: "
                f"{generation_tps:.1f} tokens/s, Running: {s['running']} reqs, Waiting: {s['waiting']} reqs, "
                f"KV cache usage: {100 * kv_cache_usage(s):.1f}%, Prefix cache hit rate: {100 * hit_rate:.1f}%")

    async def run(self) -> None:
        """Log a line every interval_s until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            line = self.line(time.monotonic())
            if line is not None:
                stats_logger.info("%s", line)
