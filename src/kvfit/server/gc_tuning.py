"""The Python garbage collector of a serving process, tuned once its start-up is done.

CPython runs a young-generation collection every 700 container allocations and, every 10 and 100 of those,
older ones that walk every tracked object. A serving process allocates in bursts (a round of thousands of
stream outputs decoded at once) over a large live heap (the model, the app, each stream's state), so the
collector ran inside those bursts: decoding one 2,000-output round took 7.6-15.9 ms with the default
thresholds next to a heap of 200,000 lists, 1.7-3.8 ms with these (a CPU, 2026-12-06). So, as many servers do:
everything alive at the end of start-up is frozen (never walked again), and the young generation is collected
every YOUNG_THRESHOLD allocations. Cycles are still collected; `LLM.generate` leaves the caller's collector alone.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger("kvfit")

YOUNG_THRESHOLD = 50_000     # container allocations between young collections (CPython's default: 700)
OLDER_THRESHOLDS = (10, 10)  # CPython's own ratios for the two older generations


def tune_gc_after_startup(process: str) -> None:
    """Freeze what start-up left alive and space the young collections out (call once, when serving begins)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
    logger.debug("%s: %d objects frozen out of the garbage collector; thresholds %s", process,
                 gc.get_freeze_count(), gc.get_threshold())
