"""Requests start their handling a few at a time, so a burst cannot hold the event loop for one long pass.

An event loop runs, each pass, every callback that was ready when the pass began. When 2,000 requests
arrive at once, uvicorn makes 2,000 tasks in one pass, and the next pass runs the first step of each:
the middleware, routing, reading and parsing the body, submitting to the engine core; hundreds of
milliseconds in which nothing else is answered, /health included (measured with profile_frontend.py's
stand-in core: /health took 500-800 ms during a burst of 2,000). StartGate lets at most `per_pass`
requests begin per pass and queues the rest in arrival order; each following pass starts the next ones.
The work is the same and done in the same order; between the starts, the loop reads sockets and answers
what is cheap (/health, /ping, /metrics and /version skip the gate: they never queue behind a burst).
"""

from __future__ import annotations

import asyncio
from collections import deque

UNGATED_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
STARTS_PER_PASS = 8       # about 32 x 0.1-0.3 ms of first steps per pass: a few ms


class StartGate:
    """ASGI middleware: HTTP requests other than UNGATED_PATHS wait for their turn, `per_pass` per loop pass."""

    def __init__(self, app, per_pass: int = STARTS_PER_PASS):
        if per_pass < 1:
            raise ValueError(f"per_pass must be at least 1, got {per_pass}")
        self.app, self.per_pass = app, per_pass
        self._waiting: deque[asyncio.Future] = deque()
        self._started = 0            # requests started in this pass
        self._pass_scheduled = False

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in UNGATED_PATHS:
            await self._turn()
        await self.app(scope, receive, send)

    async def _turn(self) -> None:
        loop = asyncio.get_running_loop()
        self._schedule_next_pass(loop)
        if self._started < self.per_pass and not self._waiting:
            self._started += 1
            return
        turn = loop.create_future()
        self._waiting.append(turn)
        await turn                  # cancelled (the server stopping): _next_pass skips it

    def _schedule_next_pass(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._pass_scheduled:
            self._pass_scheduled = True
            loop.call_soon(self._next_pass, loop)

    def _next_pass(self, loop: asyncio.AbstractEventLoop) -> None:
        """Runs once in each pass while requests start: the next `per_pass` waiting ones go."""
        self._pass_scheduled = False
        self._started = 0
        waiting = self._waiting
        while waiting and self._started < self.per_pass:
            turn = waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                self._started += 1
        if waiting or self._started:
            self._schedule_next_pass(loop)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)
