"""The message pump's batches: what piled up in an inbox comes out together, in order, and nothing after a
request's final."""

from __future__ import annotations

import asyncio

import pytest

from api.pump import KEEPALIVE, pump, pump_batches

NO_POLL = dict(keepalive_s=60.0, result_poll_s=60.0)  # the broker is only read on a result poll: none here


def delta(rid: str, n: int) -> dict:
    return {"type": "delta", "id": rid, "n": n}


def final(rid: str) -> dict:
    return {"type": "final", "id": rid}


async def collect(gen) -> list:
    return [item async for item in gen]


def test_messages_waiting_together_come_out_as_one_batch_in_order():
    async def main():
        inbox: asyncio.Queue = asyncio.Queue()
        for m in (delta("a", 0), delta("a", 1), delta("b", 0), final("a")):
            inbox.put_nowait(m)
        pending = {"a", "b"}
        loop = asyncio.get_running_loop()
        gen = pump_batches(None, inbox, pending, loop.time() + 10, **NO_POLL)
        first = await gen.__anext__()
        assert first == [delta("a", 0), delta("a", 1), delta("b", 0), final("a")]
        assert pending == {"b"}
        # later arrivals: one batch per wake-up; a message of a finished request is dropped
        loop.call_later(0.05, lambda: [inbox.put_nowait(m) for m in (delta("a", 9), delta("b", 1), final("b"),
                                                                     delta("b", 2))])
        assert await collect(gen) == [[delta("b", 1), final("b")]]
        assert pending == set() and inbox.qsize() == 1  # left for nobody: the stream is over
    asyncio.run(main())


def test_the_flat_pump_yields_the_same_messages_one_by_one():
    async def main():
        inbox: asyncio.Queue = asyncio.Queue()
        msgs = [delta("a", i) for i in range(5)] + [final("a")]
        for m in msgs:
            inbox.put_nowait(m)
        loop = asyncio.get_running_loop()
        assert await collect(pump(None, inbox, {"a"}, loop.time() + 10, **NO_POLL)) == msgs
    asyncio.run(main())


def test_a_quiet_inbox_gives_keepalives_then_the_deadline_ends_it():
    async def main():
        inbox: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        got = []
        with pytest.raises(TimeoutError):
            async for batch in pump_batches(None, inbox, {"a"}, loop.time() + 0.35, keepalive_s=0.1,
                                            result_poll_s=60.0):
                got.append(batch)
        assert got and all(b == [KEEPALIVE] for b in got) and 2 <= len(got) <= 4
    asyncio.run(main())


def test_waiting_pumps_share_one_ticker_that_forgets_each_when_it_ends():
    from api.pump import Ticker

    async def main():
        loop = asyncio.get_running_loop()
        inboxes = [asyncio.Queue() for _ in range(100)]
        pumps = [pump_batches(None, q, {f"r{i}"}, loop.time() + 10, keepalive_s=0.2, result_poll_s=60.0)
                 for i, q in enumerate(inboxes)]
        first = [asyncio.ensure_future(p.__anext__()) for p in pumps]
        await asyncio.sleep(0.01)
        ticker = Ticker.of(loop)
        assert len(ticker.due) == 100 and not ticker.task.done()
        for i, q in enumerate(inboxes):
            q.put_nowait(delta(f"r{i}", 0))
        assert [await f for f in first] == [[delta(f"r{i}", 0)] for i in range(100)]
        second = [asyncio.ensure_future(p.__anext__()) for p in pumps]
        assert all(b == [KEEPALIVE] for b in [await f for f in second])  # woken by the ticker: ~0.2 s quiet
        for p in pumps:
            await p.aclose()
        assert len(ticker.due) == 0
        await asyncio.sleep(2 * 0.05 + 0.01)
        assert ticker.task.done()  # nothing to wait for: its task ended
    asyncio.run(main())
