"""The message pump: what a reader of one or more output channels sees, with fallbacks.

Yields each message of a ``pending`` request until every one has its final; KEEPALIVE when
nothing was yielded for ``keepalive_s``; a final read from the result keys when the channel
has been quiet for ``result_poll_s`` (the message was missed: pub/sub reconnect), or a failure
for a request whose record Redis lost. Raises
TimeoutError at ``deadline`` (loop time).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator

from redis.exceptions import RedisError

from api.broker import Broker
from worker import contract as c

log = logging.getLogger(__name__)

KEEPALIVE = object()
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
    client, instead of paying a write and a wake-up per message."""
    loop = asyncio.get_running_loop()
    next_poll = loop.time() + result_poll_s
    last_sent = loop.time()
    while pending:
        now = loop.time()
        if now >= deadline:
            raise TimeoutError
        wait = min(deadline, next_poll, last_sent + keepalive_s) - now
        try:
            first = inbox.get_nowait() if not inbox.empty() else await _get_within(inbox, max(wait, 0.0))
        except asyncio.TimeoutError:
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


def _still_pending(msg: dict, pending: set[str]) -> list[dict]:
    """``[msg]`` if its request still waits for messages (dropped after its final, e.g. a polled one)."""
    if msg.get("id") not in pending:
        return []
    if msg["type"] == "final":
        pending.discard(msg["id"])
    return [msg]


if sys.version_info >= (3, 11):
    async def _get_within(inbox: asyncio.Queue, timeout_s: float):
        """The next message, or asyncio.TimeoutError after ``timeout_s``. Once per message per stream: a timeout
        on this task, not wait_for's task a call (and a message already queued is taken without either)."""
        async with asyncio.timeout(timeout_s):
            return await inbox.get()
else:  # Python 3.10
    async def _get_within(inbox: asyncio.Queue, timeout_s: float):
        return await asyncio.wait_for(inbox.get(), timeout_s)


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
