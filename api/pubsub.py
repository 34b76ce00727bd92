"""ONE pub/sub connection per API process, multiplexed over all request channels.

A listener task reads the connection and hands each message to the asyncio queues
registered for its channel. ``subscribe`` sends SUBSCRIBE and waits until the
listener has seen Redis confirm it, so a request is added to the stream only once
its channel is live and nothing is published to an empty channel.

After a lost connection redis-py re-subscribes every channel on reconnect;
messages published in between are lost, which is why callers also poll the
result keys (``GenerationService``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from worker import contract as c

log = logging.getLogger(__name__)

SUBSCRIBE_TIMEOUT_S = 5.0


@dataclass
class _Channel:
    confirmed: asyncio.Future
    inboxes: set[asyncio.Queue] = field(default_factory=set)


class SubscribeTimeout(Exception):
    pass


class Multiplexer:
    def __init__(self, client: aioredis.Redis):
        self._pubsub = client.pubsub()
        self._channels: dict[str, _Channel] = {}
        self._lock = asyncio.Lock()  # one SUBSCRIBE/UNSUBSCRIBE write at a time
        self._task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.num_reconnects = 0

    @property
    def num_channels(self) -> int:
        return len(self._channels)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="gaggle-pubsub-listener")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._pubsub.aclose()

    # -- subscriptions -------------------------------------------------------------------

    async def subscribe(self, channels: list[str], inbox: asyncio.Queue) -> None:
        """Route ``channels`` to ``inbox``; returns once Redis confirmed every subscription."""
        loop = asyncio.get_running_loop()
        new = []
        for name in channels:
            ch = self._channels.get(name)
            if ch is None:
                ch = self._channels[name] = _Channel(loop.create_future())
                new.append(name)
            ch.inboxes.add(inbox)
        try:
            if new:
                async with self._lock:
                    await self._pubsub.subscribe(*new)
            waits = [asyncio.shield(self._channels[name].confirmed) for name in channels]
            await asyncio.wait_for(asyncio.gather(*waits), SUBSCRIBE_TIMEOUT_S)
        except (RedisError, OSError, asyncio.TimeoutError) as e:
            await self.unsubscribe(channels, inbox)
            raise SubscribeTimeout(f"could not subscribe to the output channel: {e!r}") from e

    async def unsubscribe(self, channels: list[str], inbox: asyncio.Queue) -> None:
        gone = []
        for name in channels:
            ch = self._channels.get(name)
            if ch is None:
                continue
            ch.inboxes.discard(inbox)
            if not ch.inboxes:
                del self._channels[name]
                if not ch.confirmed.done():
                    ch.confirmed.cancel()
                gone.append(name)
        if gone:
            try:
                async with self._lock:
                    await self._pubsub.unsubscribe(*gone)
            except (RedisError, OSError) as e:  # resubscribed on reconnect only if still known: harmless
                log.warning("unsubscribe failed", extra={"channels": len(gone), "error": str(e)})

    async def _unsubscribe_stale(self, name: str) -> None:
        try:
            async with self._lock:  # checked under the lock: a new subscribe() sends after us
                if name not in self._channels:
                    await self._pubsub.unsubscribe(name)
        except (RedisError, OSError) as e:
            log.warning("unsubscribe failed", extra={"channel": name, "error": str(e)})

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- listener --------------------------------------------------------------------------

    async def _listen(self) -> None:
        backoff = 0.05
        while True:
            try:
                if self._pubsub.connection is None:
                    await self._pubsub.connect()
                message = await self._pubsub.get_message(timeout=1.0)
                backoff = 0.05
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as e:
                self.num_reconnects += 1
                log.warning("pub/sub connection lost; reconnecting", extra={"error": str(e)})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            except Exception:
                log.exception("pub/sub listener error")
                await asyncio.sleep(0.1)
                continue
            if message is not None:
                self._dispatch(message)

    def _dispatch(self, message: dict) -> None:
        kind = message["type"]
        channel = message["channel"]
        name = channel.decode() if isinstance(channel, bytes) else str(channel)
        ch = self._channels.get(name)
        if ch is None:
            if kind == "message":  # left over (e.g. re-subscribed on reconnect while unsubscribing): drop it
                self._spawn(self._unsubscribe_stale(name))
            return
        if kind == "subscribe":
            if not ch.confirmed.done():
                ch.confirmed.set_result(True)
        elif kind == "message":
            try:
                body = c.loads_versioned(message["data"])
            except c.SchemaError as e:
                log.error("undecodable message on an output channel", extra={"channel": name, "error": str(e)})
                return
            for inbox in ch.inboxes:
                inbox.put_nowait(body)
