"""Helpers shared by the engine subcommands."""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from contextlib import contextmanager

from kvfit.units import duration


def setup_logging() -> None:
    """Every command's log in the server's one format (level, time, logger: kvfit.server.logs)."""
    from kvfit.server.logs import configure_logging
    configure_logging("info")


def add_sampling_flags(p) -> None:
    """Sampling flags; one left out takes --generation-config's default, else vLLM's (as a request does)."""
    from kvfit.commands.flags import int_flag
    p.add_argument("--max-tokens", type=int_flag, default=None,
                   help="tokens to generate per prompt (default: the generation config's max_new_tokens, else 16)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the generation config's, else 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set of tokens whose "
                   "probabilities add up to this (default: the generation config's, else 1.0)")
    p.add_argument("--top-k", type=int_flag, default=None,
                   help="sample among the k likeliest tokens, -1: all (default: the generation config's, else -1)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def sampling_params(args, seed, defaults):
    """The flags' SamplingParams over `defaults` (LLM.get_default_sampling_params())."""
    given = {name: getattr(args, name) for name in ("temperature", "top_p", "top_k", "max_tokens")
             if getattr(args, name) is not None}
    return dataclasses.replace(defaults, seed=seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos, **given)


# --- a slow start-up (the CPU's, for a large model): say so and show it is still going -------------------
PROGRESS_EVERY_S = 30.0          # seconds between "still starting" lines


def _slow_start(config) -> tuple[float, str] | None:
    """The platform's (seconds, warning) where starting config's engine is estimated to take long, else None."""
    from kvfit.platforms import get_platform
    return get_platform(config.device.device).startup_estimate(config)


def _notice(level: int, message: str) -> None:
    """A start-up notice on stderr in the log's one format (kvfit.server.logs), shown whether or not
    logging is configured (a notice the user waits on is never dropped)."""
    from kvfit.server.logs import LOG_DATE_FORMAT, LOG_FORMAT
    record = logging.LogRecord("kvfit", level, __file__, 0, message, None, None)
    print(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT).format(record), file=sys.stderr, flush=True)


def _progress(stop: threading.Event, start: float, seconds: float, every: float) -> None:
    while not stop.wait(every):
        _notice(logging.INFO, f"still starting, {duration(time.monotonic() - start)} of about "
                              f"{duration(seconds)} (estimated)")


@contextmanager
def engine_startup(config):
    """Around building the engine: when the platform estimates starting to take long (the CPU's, for a large
    model), a warning with the estimate first, then a "still starting" line every PROGRESS_EVERY_S until the engine is up."""
    notice = _slow_start(config)
    if notice is None:
        yield
        return
    seconds, warning = notice
    _notice(logging.WARNING, warning.removeprefix("warning: "))
    start, stop = time.monotonic(), threading.Event()
    ticker = threading.Thread(target=_progress, args=(stop, start, seconds, PROGRESS_EVERY_S), daemon=True,
                              name="kvfit-startup-progress")
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
    _notice(logging.INFO, f"started in {duration(time.monotonic() - start)}")
