"""Review: the loop side of EngineCoreClient keeps applying the core's outputs after one piece of its work
raised (a bug settling an add, ending requests): the drain that hit it must not stay marked as running, or
every later batch waits in the queue forever while /health still says the core is fine."""

from __future__ import annotations

import asyncio
import collections

from kvfit.server.async_engine import RequestStream
from kvfit.server.core_process import EngineCoreClient
from kvfit.server.core_protocol import OutputAccumulator, OutputBatch, RequestDelta, SampleDelta


def test_work_after_a_failing_piece_is_still_applied():
    async def run():
        loop = asyncio.get_running_loop()
        client = EngineCoreClient.__new__(EngineCoreClient)
        client._streams, client._pending, client._stats, client.dead_reason = {}, {}, {}, None
        client._work, client._draining, client._loop = collections.deque(), False, loop
        stream = RequestStream("r")
        client._streams["r"] = (stream, OutputAccumulator("r", [1]))

        def broken():
            raise RuntimeError("a bug on the loop side")
        client._call_on_loop(broken)
        delta = RequestDelta("r", True, [SampleDelta(0, 0, "hi", [7], None, None, "length", None)])
        client._hand_over(client._batch_pieces(OutputBatch([], [delta], [], {"running": 0}), 0.0))
        output = await asyncio.wait_for(stream.next(), 2)
        assert output.outputs[0].text == "hi" and client._stats == {"running": 0}
        for _ in range(3):
            await asyncio.sleep(0)
        assert not client._work and not client._draining
    asyncio.run(run())
