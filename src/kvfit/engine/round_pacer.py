"""How many decode steps the next multi-step round may take while a server's requests arrive.

A round of K decode steps (--num-scheduler-steps) goes on the device at once, and with async scheduling the
next round is launched before the current one is read. A request that arrives during a round is admitted
into the round after the one in flight, so it waits about 1.5 rounds before its prefill runs: at K = 8 and
2.4 ms a step (qwen3-0.6b on an H100) that is about 30 ms of time to first token, against about 4 ms at
K = 1. Long rounds only pay when nobody arrives. So a serving core asks the pacer before each step:

- no request arrived in the last window, or no batch slot is free (an arrival would wait for a slot
  anyway): the full K;
- otherwise the longest round during which fewer than `arrivals_per_round` requests are expected to arrive
  (rate over the window x seconds per decode step), at least 1 step.

Offline generation (all requests given at once) never asks, and keeps K.
"""

from __future__ import annotations

from collections import deque

# the rate is read over this window of arrival times (a burst at rate inf ages out within it)
WINDOW_S = 1.0
# the expected arrivals one round may span; at 0.2 a request finds a round in flight about 1 time in 5
ARRIVALS_PER_ROUND = 0.2
# weight of the newest round in the moving average of seconds per decode step
STEP_TIME_WEIGHT = 0.2


class RoundPacer:
    """Arrival times and step times of one serving loop; not thread-safe (the loop owns it)."""

    def __init__(self, max_steps: int, window_s: float = WINDOW_S, arrivals_per_round: float = ARRIVALS_PER_ROUND):
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        self.max_steps = max_steps
        self.window_s = window_s
        self.arrivals_per_round = arrivals_per_round
        self._arrivals: deque[float] = deque()     # monotonic seconds of the arrivals in the window, oldest first
        self.step_seconds: float | None = None     # moving average of one decode step's wall time

    def arrived(self, now: float) -> None:
        """A request was added at `now` (monotonic seconds)."""
        self._arrivals.append(now)
        self._forget_before(now - self.window_s)

    def round_ran(self, seconds: float, num_steps: int) -> None:
        """A round of num_steps steps took `seconds` of wall time (from its launch to its tokens read)."""
        if num_steps < 1 or seconds <= 0:
            return
        per_step = seconds / num_steps
        if self.step_seconds is None:
            self.step_seconds = per_step
        else:
            self.step_seconds += STEP_TIME_WEIGHT * (per_step - self.step_seconds)

    def arrival_rate(self, now: float) -> float:
        """Requests per second over the last window."""
        self._forget_before(now - self.window_s)
        return len(self._arrivals) / self.window_s

    def steps(self, now: float, slot_free: bool) -> int:
        """Decode steps the next round may take (1..max_steps)."""
        if self.max_steps == 1 or not slot_free or self.step_seconds is None:
            return self.max_steps
        rate = self.arrival_rate(now)
        if rate == 0:
            return self.max_steps
        fitting = int(self.arrivals_per_round / (rate * self.step_seconds))
        return max(1, min(self.max_steps, fitting))

    def _forget_before(self, cutoff: float) -> None:
        while self._arrivals and self._arrivals[0] < cutoff:
            self._arrivals.popleft()
