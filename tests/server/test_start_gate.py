"""StartGate: a burst of requests starts a few per event-loop pass, in arrival order; cheap paths never wait."""

import asyncio

import pytest

from kvfit.server.start_gate import UNGATED_PATHS, StartGate


def run_burst(per_pass: int, paths: list[str], cancel: set[int] = frozenset()):
    """Each request's app call records (index, loop pass it started in); passes are counted by a ticker."""
    started: list[tuple[int, int]] = []
    passes = 0

    async def app(scope, receive, send):
        started.append((scope["index"], passes))

    gate = StartGate(app, per_pass=per_pass)

    async def main():
        loop = asyncio.get_running_loop()
        stop = False

        def tick():
            nonlocal passes
            passes += 1
            if not stop:
                loop.call_soon(tick)

        loop.call_soon(tick)
        tasks = [asyncio.create_task(gate({"type": "http", "path": path, "index": i}, None, None))
                 for i, path in enumerate(paths)]
        for i in cancel:
            await asyncio.sleep(0)
            tasks[i].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stop = True
        return gate.num_waiting

    left = asyncio.run(main())
    return started, left


def test_a_burst_starts_per_pass_requests_each_pass_in_arrival_order():
    started, left = run_burst(8, ["/v1/completions"] * 100)
    assert [i for i, _ in started] == list(range(100))
    per_pass = {}
    for _, p in started:
        per_pass[p] = per_pass.get(p, 0) + 1
    assert max(per_pass.values()) <= 8
    assert len(per_pass) >= 100 // 8            # spread over at least that many passes
    assert left == 0


def test_cheap_paths_skip_the_queue():
    paths = ["/v1/chat/completions"] * 64 + sorted(UNGATED_PATHS)
    started, _ = run_burst(4, paths)
    first_pass = min(p for _, p in started)
    cheap = [p for i, p in started if i >= 64]
    assert cheap and all(p == first_pass for p in cheap)     # answered in the burst's first pass
    assert sorted(i for i, _ in started) == list(range(len(paths)))


def test_a_cancelled_waiter_is_skipped_and_takes_no_turn():
    started, left = run_burst(2, ["/v1/completions"] * 20, cancel={10, 11})
    assert sorted(i for i, _ in started) == [i for i in range(20) if i not in (10, 11)]
    assert left == 0


def test_per_pass_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        StartGate(None, per_pass=0)
