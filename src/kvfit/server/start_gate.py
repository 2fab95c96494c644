"""Requests start their handling a few at a time, so a burst cannot hold the event loop for one long pass.

An event loop runs, each pass, every callback that was ready when the pass began. When 2,000 requests
arrive at once, uvicorn makes 2,000 tasks in one pass, and the next pass runs the first step of each:
the middleware, routing, reading and parsing the body, submitting to the engine core; hundreds of
milliseconds in which nothing else is answered, /health included (measured with profile_frontend.py's
stand-in core: /health took 500-800 ms during a burst of 2,000). StartGate queues every request in arrival
order and lets at most `per_pass` of them begin per pass.
The work is the same and done in the same order; between the starts, the loop reads sockets and answers
what is cheap (/health, /ping, /metrics and /version skip the gate: they never queue behind a burst).
"""

from __future__ import annotations

import asyncio
from collections import deque

UNGATED_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
STARTS_PER_PASS = 8       # 8 x 0.1-0.3 ms of first steps per pass: at most a few ms


class StartGate:
    """ASGI middleware: HTTP requests other than UNGATED_PATHS wait for their turn, `per_pass` per loop pass."""

    def __init__(self, app, per_pass: int = STARTS_PER_PASS):
        if per_pass < 1:
            raise ValueError(f"per_pass must be at least 1, got {per_pass}")
        self.app, self.per_pass = app, per_pass
        self._waiting: deque[asyncio.Future] = deque()
        self._pass_scheduled = False

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in UNGATED_PATHS:
            await self._turn()
        await self.app(scope, receive, send)

    async def _turn(self) -> None:
        """Queue, and wait for a pass that starts this request: even an idle gate lets a request through only
        at the next pass (microseconds), so no pass starts more than per_pass and none overtakes a waiter."""
        loop = asyncio.get_running_loop()
        turn = loop.create_future()
        self._waiting.append(turn)
        self._schedule_next_pass(loop)
        await turn                  # cancelled (the client or the server going away): _next_pass skips it

    def _schedule_next_pass(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._pass_scheduled:
            self._pass_scheduled = True
            loop.call_soon(self._next_pass, loop)

    def _next_pass(self, loop: asyncio.AbstractEventLoop) -> None:
        """Runs at most once a pass while requests wait: the next `per_pass` of them go (their tasks run in the
        pass after this one, where nothing else can start one)."""
        self._pass_scheduled = False
        waiting, released = self._waiting, 0
        while waiting and released < self.per_pass:
            turn = waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                released += 1
        if waiting:
            self._schedule_next_pass(loop)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)
