"""Waiting on submitted requests: their messages until a deadline, what is left cancelled, the inbox unrouted.

The sync path (``api.generation``), its SSE sessions (``api.streaming``) and async watchers
(``api.async_requests``) all wait this way; it lives apart from them so that none imports another for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from redis.exceptions import RedisError

from api.broker import Broker
from api.jobs import Job
from api.pump import KEEPALIVE, pump, pump_batches
from api.settings import Settings
from worker import contract as c

log = logging.getLogger(__name__)


class Replies:
    def __init__(self, broker: Broker, settings: Settings):
        self.broker = broker
        self.settings = settings

    @property
    def timeout_s(self) -> float:
        """How long a sync request is waited for before it is cancelled."""
        return self.settings.request_timeout_s

    def deadline(self, job: Job) -> float:
        return job.started + self.timeout_s  # loop.time() is time.monotonic() too

    def pump(self, inbox: asyncio.Queue, pending: set[str], deadline: float) -> AsyncIterator:
        """The messages of the ``pending`` requests until each has its final (``api.pump``)."""
        return pump(self.broker, inbox, pending, deadline, keepalive_s=self.settings.keepalive_s,
                    result_poll_s=self.settings.result_poll_s)

    def pump_batches(self, inbox: asyncio.Queue, pending: set[str], deadline: float) -> AsyncIterator[list]:
        """The same messages, each batch what had arrived by the time it was read (``api.pump``)."""
        return pump_batches(self.broker, inbox, pending, deadline, keepalive_s=self.settings.keepalive_s,
                            result_poll_s=self.settings.result_poll_s)

    async def collect(self, inbox: asyncio.Queue, pending: set[str], deadline: float) -> dict[str, c.Result]:
        """The final results of the ``pending`` requests, by id."""
        results = {}
        async for msg in self.pump(inbox, pending, deadline):
            if msg is not KEEPALIVE and msg["type"] == "final":
                results[msg["id"]] = c.Result.from_dict(msg["result"])
        return results

    async def cancel(self, request_ids: list[str], reason: str) -> None:
        """Cancel now (the caller is not itself being cancelled); failures are logged, not raised."""
        try:
            await self.broker.cancel(request_ids)
        except (RedisError, OSError) as e:
            log.error("could not cancel", extra={"request_ids": request_ids, "reason": reason, "error": str(e)})
            return
        for rid in request_ids:
            log.info("request cancelled", extra={"request_id": rid, "reason": reason})

    def cancel_soon(self, request_ids: list[str], reason: str) -> None:
        """Cancel in the background (the caller may itself be being cancelled)."""
        self.broker.cancel_soon(request_ids, reason)

    async def release(self, job: Job, inbox: asyncio.Queue) -> None:
        """Stop routing the job's messages to ``inbox``."""
        self.broker.channels.unroute(job.request_ids, inbox)
