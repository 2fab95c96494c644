"""HeadroomWatch: while serving, device memory outside kvfit's plan is watched; admission slows before an OOM.

The KV cache, the weights and the profiled activation peak are all inside the plan, so once the engine is
warm the device's free memory only shrinks when something outside the plan grows: another process, a
library's buffers, fragmentation. Every CHECK_EVERY_STEPS steps (one cudaMemGetInfo, outside the kernels)
the free memory is read; below the low mark new requests stop being admitted while any request runs (the
running ones finish and give their blocks back; a request still runs alone, so nothing waits forever), a
warning says why, and once free memory is back above twice the low mark admission resumes. Platforms that
cannot say (the CPU) are never throttled. The reading is a stats field (`device_headroom_bytes`), the
server's `kvfit:device_headroom_bytes` gauge.
"""

from __future__ import annotations

import logging
from typing import Callable

from kvfit.units import MiB, gib

logger = logging.getLogger("kvfit")

CHECK_EVERY_STEPS = 16
MIN_HEADROOM_BYTES = 256 * MiB          # the low mark's floor
HEADROOM_SHARE = 0.01                   # ... or this share of the device, if larger


class HeadroomWatch:
    """Reads free device memory now and then; says whether admission is paused."""

    def __init__(self, free_bytes: Callable[[], int | None], total_bytes: int | None,
                 check_every_steps: int = CHECK_EVERY_STEPS):
        self._free_bytes = free_bytes
        self.low_bytes = max(MIN_HEADROOM_BYTES, int((total_bytes or 0) * HEADROOM_SHARE))
        self.check_every_steps = check_every_steps
        self.headroom_bytes: int | None = None
        self.paused = False
        self._steps = 0

    def after_step(self) -> bool:
        """Count a step; every check_every_steps read the headroom. Whether admission is paused."""
        self._steps += 1
        if self._steps % self.check_every_steps == 0:
            self.check()
        return self.paused

    def check(self) -> bool:
        free = self._free_bytes()
        self.headroom_bytes = free
        if free is None:
            return self.paused
        if not self.paused and free < self.low_bytes:
            self.paused = True
            logger.warning("device memory outside kvfit's plan grew: %s free, under the %s kvfit keeps for "
                           "safety (another process or a library's buffers); new requests wait while others run "
                           "until it is back above %s", gib(free), gib(self.low_bytes), gib(2 * self.low_bytes))
        elif self.paused and free >= 2 * self.low_bytes:
            self.paused = False
            logger.info("device memory back to %s free: admitting new requests again", gib(free))
        return self.paused
