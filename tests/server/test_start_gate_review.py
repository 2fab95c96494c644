"""Review of b2b9cd5: StartGate's stated bound and order, counted in real event-loop passes, and the cost of what
the completions handler now parses on the event loop."""

import asyncio
import time

from kvfit.server.prepare import INLINE_BODY_BYTES, PrepareContext, parse_request
from kvfit.server.protocol import APIError, CompletionRequest
from kvfit.server.start_gate import StartGate


class CountingLoop(asyncio.SelectorEventLoop):
    """An asyncio loop that counts its passes (_run_once), so a start is placed in its real pass."""

    passes = 0

    def _run_once(self):
        self.passes += 1
        super()._run_once()


def starts(per_pass: int, waves: list[int]) -> list[tuple[int, int]]:
    """(arrival index, pass) of each request's start; waves[k] requests arrive in the k-th pass."""
    loop = CountingLoop()
    started = []

    async def app(scope, receive, send):
        started.append((scope["index"], loop.passes))

    async def main():
        gate, tasks = StartGate(app, per_pass), []
        for n in waves:
            for _ in range(n):
                scope = {"type": "http", "path": "/v1/completions", "index": len(tasks)}
                tasks.append(asyncio.ensure_future(gate(scope, None, None)))
            await asyncio.sleep(0)          # the next wave arrives one pass later
        await asyncio.gather(*tasks)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return started


def test_no_real_pass_starts_more_than_per_pass_requests():
    # 16 queue; as the last of them are released, 16 more arrive: a released batch and the arrivals after the
    # next pass's reset start in the same pass (16 with per_pass 8)
    per_pass = {}
    for _, p in starts(8, [16, 0, 16]):
        per_pass[p] = per_pass.get(p, 0) + 1
    assert max(per_pass.values()) <= 8, sorted(per_pass.values(), reverse=True)


def test_a_released_waiter_is_not_overtaken_by_later_arrivals():
    # request 8 queues and is released; requests 9.. arrive in that pass, find the queue empty and start at once
    order = [i for i, _ in starts(8, [9, 8])]
    assert order == sorted(order), order


def test_an_inline_completions_body_of_bad_items_costs_what_a_good_one_does():
    # a completions body up to INLINE_BODY_BYTES is parsed on the event loop (prepare.py: "tens of microseconds,
    # at most a few hundred"); a prompt of {} items must not make pydantic build one error per item and union
    # member: one short error, in about the time a valid body of the same size takes (relative to this machine,
    # best of 5 each, with a wide margin: no absolute time is asserted)
    head, tail = b'{"model":"m","prompt":[0,', b"{}]}"
    raw = head + b"{}," * ((INLINE_BODY_BYTES - len(head) - len(tail)) // 3) + tail
    good = head + b"1," * ((INLINE_BODY_BYTES - len(head) - 3) // 2) + b"1]}"
    assert len(raw) <= INLINE_BODY_BYTES and len(good) <= INLINE_BODY_BYTES
    context = PrepareContext(("m",), None, 10**6, 128)

    def best_of(body: bytes) -> float:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            try:
                parse_request(body, CompletionRequest, context)
            except APIError as exc:
                assert exc.status == 400 and "\n" not in str(exc) and len(str(exc)) < 300, str(exc)[:500]
            best = min(best, time.perf_counter() - start)
        return best
    bad, fine = best_of(raw), best_of(good)
    assert bad < 20 * fine + 0.002, f"{bad * 1e3:.2f} ms for {len(raw)} bytes of bad items, {fine * 1e3:.2f} ms valid"
