"""The message pump: what a reader of one or more output channels sees, with fallbacks.

Yields each message of a ``pending`` request until every one has its final; KEEPALIVE when
nothing was yielded for ``keepalive_s``; a final read from the result keys when the channel
has been quiet for ``result_poll_s`` (the message was missed: pub/sub reconnect), or a failure
for a request whose record Redis lost. Raises
TimeoutError at ``deadline`` (loop time). Those times are kept by one ``Ticker`` per event loop, not by a timer
per wait.
"""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from collections.abc import AsyncIterator

from redis.exceptions import RedisError

from api.broker import Broker
from worker import contract as c

log = logging.getLogger(__name__)

KEEPALIVE = object()
TICK = object()  # put into a waiting inbox by the Ticker: a deadline, result poll or keep-alive is due
TICK_S = 0.05  # how late such a wake-up may come
LOST = "the request was lost: Redis no longer has it (restarted without its data, or flushed); send it again"


async def pump(broker: Broker, inbox: asyncio.Queue, pending: set[str], deadline: float, *,
               keepalive_s: float, result_poll_s: float) -> AsyncIterator:
    """Each message (or KEEPALIVE) of ``pump_batches``, one at a time."""
    async for batch in pump_batches(broker, inbox, pending, deadline, keepalive_s=keepalive_s,
                                    result_poll_s=result_poll_s):
        for msg in batch:
            yield msg


async def pump_batches(broker: Broker, inbox: asyncio.Queue, pending: set[str], deadline: float, *,
                       keepalive_s: float, result_poll_s: float) -> AsyncIterator[list]:
    """The messages as lists: the one awaited and every other already in the inbox. A reader that has fallen
    behind (a busy event loop, a slow client) handles what piled up in one go, e.g. as one write to its
    client, instead of paying a write and a wake-up per message. A wait for the next message is a plain queue
    get: the loop's ``Ticker`` wakes it when its deadline, result poll or keep-alive is due."""
    loop = asyncio.get_running_loop()
    ticker = Ticker.of(loop)
    next_poll = loop.time() + result_poll_s
    last_sent = loop.time()
    try:
        while pending:
            now = loop.time()
            if now >= deadline:
                raise TimeoutError
            due = min(deadline, next_poll, last_sent + keepalive_s)
            if not inbox.empty():
                first = inbox.get_nowait()
            elif due <= now:
                first = TICK
            else:
                ticker.wake_at(inbox, due)
                first = await inbox.get()
            if first is TICK:
                now = loop.time()
                batch = []
                if now >= next_poll:
                    next_poll = now + result_poll_s
                    for msg in await _poll_results(broker, pending):
                        pending.discard(msg["id"])
                        batch.append(msg)
                if pending and not batch and now - last_sent >= keepalive_s:
                    batch.append(KEEPALIVE)
                if batch:
                    last_sent = now
                    yield batch
                continue
            batch = _still_pending(first, pending)
            while pending and not inbox.empty():
                batch += _still_pending(inbox.get_nowait(), pending)
            if batch:
                last_sent = loop.time()
                yield batch
    finally:
        ticker.forget(inbox)


def _still_pending(msg, pending: set[str]) -> list[dict]:
    """``[msg]`` if its request still waits for messages (dropped after its final, e.g. a polled one; a tick
    that came with messages says nothing)."""
    if msg is TICK or msg.get("id") not in pending:
        return []
    if msg["type"] == "final":
        pending.discard(msg["id"])
    return [msg]


class Ticker:
    """One timer per event loop for every waiting pump, instead of one scheduled and cancelled per message (~4 µs
    each; streaming 262k tokens through one API process took ~10% less CPU without them). A pump says when it next
    needs to wake (``wake_at``); every ``TICK_S`` the ticker puts ``TICK`` into each inbox whose time has come and
    that is still empty, once. Its task runs while some pump waits."""

    _of_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.due: dict[asyncio.Queue, float] = {}  # inbox -> loop time to wake it (a pump forgets its own at its end)
        self.task: asyncio.Task | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Ticker:
        ticker = cls._of_loop.get(loop)
        if ticker is None:
            ticker = cls._of_loop[loop] = cls(loop)
        return ticker

    def wake_at(self, inbox: asyncio.Queue, when: float) -> None:
        self.due[inbox] = when
        if self.task is None or self.task.done():
            self.task = self.loop.create_task(self._run(), name="pump-ticker")

    def forget(self, inbox: asyncio.Queue) -> None:
        self.due.pop(inbox, None)

    async def _run(self) -> None:
        while self.due:
            await asyncio.sleep(TICK_S)
            now = self.loop.time()
            for inbox, when in list(self.due.items()):
                if when <= now and inbox.empty():
                    inbox.put_nowait(TICK)
                    self.due[inbox] = math.inf  # once: the pump says its next time when it waits again


async def _poll_results(broker: Broker, pending: set[str]) -> list[dict]:
    """Finals the channel did not bring: results already stored, and failures for requests Redis lost (their
    record is gone: nothing will ever answer them, so the caller hears it now, not at its timeout)."""
    try:
        found, lost = await broker.finals(sorted(pending))
    except (RedisError, OSError) as e:
        log.warning("result poll failed", extra={"error": str(e)})
        return []
    for rid in found:
        log.info("final result found by polling", extra={"request_id": rid})
    for rid in lost:
        log.warning("request lost: redis no longer has it", extra={"request_id": rid})
        found[rid] = c.error_result(rid, c.STATUS_FAILED, LOST, "request_lost")
    return [{"type": "final", "id": rid, "result": r.to_dict()} for rid, r in found.items()]
