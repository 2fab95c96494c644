"""RequestStream.next: outputs are cumulative, so those that wait are folded into the newest (one SSE event for
them), and an error queued behind them still reaches the client."""

from __future__ import annotations

import asyncio

import pytest

from kvfit.engine.output import CompletionOutput, RequestOutput
from kvfit.server.async_engine import RequestStream
from kvfit.server.protocol import APIError


def _output(num_tokens: int, finished: bool = False) -> RequestOutput:
    sample = CompletionOutput(0, "x" * num_tokens, list(range(num_tokens)))
    return RequestOutput("r", None, [1, 2], outputs=[sample], finished=finished)


def test_waiting_outputs_fold_into_the_newest_and_an_error_behind_them_follows():
    async def run():
        progress = []
        stream = RequestStream("r", on_progress=lambda *args: progress.append(args[1]))
        stream.count_from(2)
        for n in (1, 2, 3):
            stream.put(_output(n), float(n))
        error = APIError(500, "boom", "server_error")
        stream.put(error)
        first = await stream.next()
        # one SSE event, but each folded output is counted as it arrived (one inter-token latency per step)
        assert len(first.outputs[0].token_ids) == 3 and progress == [1, 1, 1]
        with pytest.raises(APIError):
            await stream.next()
        assert stream.finished and stream.error is error
        one = RequestStream("s")
        one.put(_output(1), 1.0)
        assert len((await one.next()).outputs[0].token_ids) == 1           # nothing waiting: the one output
        one.put(_output(4, finished=True), 2.0)
        assert (await one.next()).finished and one.finished
    asyncio.run(run())


def test_outputs_that_arrive_before_the_add_returns_are_counted_when_it_does():
    """Under load the core's add reply and the request's first step reach the loop in one go: the first output is
    put before add() has returned. Its prompt tokens, first-token time and tokens are counted when it returns (they
    were counted nowhere: the progress callback and the prompt's size were not set yet)."""
    calls = []
    stream = RequestStream("r", on_progress=lambda *args: calls.append(args))
    stream.put(_output(1), 10.5)
    stream.put(_output(3), 10.7)
    assert calls == []
    stream.arrival_time = 10.0
    stream.count_from(5)
    assert [(c[0], c[1]) for c in calls] == [(5, 1), (0, 2)]
    assert calls[0][2] == 0.5 and abs(calls[1][3] - 0.2) < 1e-9
    stream.put(_output(4), 11.0)
    assert calls[-1][:2] == (0, 1)
