"""ONE pub/sub connection per API process, multiplexed over its reply channel and request channels.

A listener task reads the connection and hands each message to the asyncio queues
registered for it. The process's reply channel (``contract.reply_channel``) carries the
messages of every request that names it (several per PUBLISH, routed by request id:
``route``); other requests' own channels are subscribed one by one (``subscribe``:
async requests' event streams). Either way a caller returns only once Redis confirmed
the subscription, so a request is added to the stream only once its messages have a
live channel and nothing is published to an empty channel.

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
    def __init__(self, client: aioredis.Redis, reply_channel: str):
        self._pubsub = client.pubsub()
        self._channels: dict[str, _Channel] = {}
        self.reply_channel = reply_channel
        self._reply: _Channel | None = None  # made on start (it needs the loop)
        self._routes: dict[str, set[asyncio.Queue]] = {}  # request id -> inboxes, for the reply channel
        self._lock = asyncio.Lock()  # one SUBSCRIBE/UNSUBSCRIBE write at a time
        self._task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # UNSUBSCRIBEs sent from tasks of their own
        self._stale: set[str] = set()  # channels with messages but no reader, being unsubscribed
        self.num_reconnects = 0

    @property
    def num_channels(self) -> int:
        return len(self._channels)

    @property
    def num_routes(self) -> int:
        return len(self._routes)

    async def start(self) -> None:
        """Connect (or leave it to the listener, which retries), start the listener, subscribe to the reply
        channel (confirmed later if Redis is not up yet: ``route`` waits for it)."""
        self._reply = _Channel(asyncio.get_running_loop().create_future())
        try:
            await self._pubsub.connect()
        except (RedisError, OSError) as e:
            log.warning("pub/sub connection not established yet", extra={"error": str(e)})
        self._task = asyncio.create_task(self._listen(), name="gaggle-pubsub-listener")
        try:
            await self._send_subscribe([self.reply_channel], asyncio.get_running_loop().time() + SUBSCRIBE_TIMEOUT_S)
        except (RedisError, OSError) as e:
            log.warning("reply channel not subscribed yet", extra={"error": str(e)})

    # -- the reply channel ---------------------------------------------------------------

    async def route(self, request_ids: list[str], inbox: asyncio.Queue) -> None:
        """Hand the reply channel's messages of ``request_ids`` to ``inbox``; returns once the reply channel
        is confirmed (it normally is since start; after a failed start this subscribes again)."""
        for rid in request_ids:
            self._routes.setdefault(rid, set()).add(inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SUBSCRIBE_TIMEOUT_S
        try:
            if not self._reply.confirmed.done():
                await self._send_subscribe([self.reply_channel], deadline)
                await asyncio.wait_for(asyncio.shield(self._reply.confirmed), max(0.0, deadline - loop.time()))
        except (RedisError, OSError, asyncio.TimeoutError) as e:
            self.unroute(request_ids, inbox)
            raise SubscribeTimeout(f"could not subscribe to the reply channel: {e!r}") from e
        except BaseException:
            self.unroute(request_ids, inbox)
            raise

    def unroute(self, request_ids: list[str], inbox: asyncio.Queue) -> None:
        for rid in request_ids:
            inboxes = self._routes.get(rid)
            if inboxes is not None:
                inboxes.discard(inbox)
                if not inboxes:
                    del self._routes[rid]

    def _dispatch_reply(self, kind: str, data) -> None:
        if kind == "subscribe":
            if not self._reply.confirmed.done():
                self._reply.confirmed.set_result(True)
            return
        if kind != "message":
            return
        for part in c.split_messages(data):
            try:
                body = c.loads_versioned(part)
            except c.SchemaError as e:
                log.error("undecodable message on the reply channel", extra={"error": str(e)})
                continue
            for inbox in self._routes.get(body.get("id"), ()):
                inbox.put_nowait(body)

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
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
        deadline = loop.time() + SUBSCRIBE_TIMEOUT_S
        try:
            if new:
                await self._send_subscribe(new, deadline)
            waits = [asyncio.shield(self._channels[name].confirmed) for name in channels]
            await asyncio.wait_for(asyncio.gather(*waits), max(0.0, deadline - loop.time()))
        except (RedisError, OSError, asyncio.TimeoutError) as e:
            self.unsubscribe_soon(channels, inbox)
            raise SubscribeTimeout(f"could not subscribe to the output channel: {e!r}") from e
        except BaseException:  # cancelled: leave nothing registered
            self.unsubscribe_soon(channels, inbox)
            raise

    async def _send_subscribe(self, names: list[str], deadline: float) -> None:
        """SUBSCRIBE, retried until ``deadline`` while the connection is down or being re-established (after a
        Redis restart the listener reconnects; the first command may meet the dead socket)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with self._lock:
                    if self._pubsub.connection is None:  # only the listener makes the first connection
                        raise RedisError("not connected to redis yet")
                    wanted = [name for name in names if name in self._channels or name == self.reply_channel]
                    if wanted:
                        await self._pubsub.subscribe(*wanted)
                return
            except (RedisError, OSError):
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.05)

    async def unsubscribe(self, channels: list[str], inbox: asyncio.Queue) -> None:
        await self._send_unsubscribe(self._forget(channels, inbox))

    def unsubscribe_soon(self, channels: list[str], inbox: asyncio.Queue) -> None:
        """From code that may be cancelled: forget now, send UNSUBSCRIBE from a task of its own."""
        gone = self._forget(channels, inbox)
        if gone:
            self._spawn(self._send_unsubscribe(gone))

    def _forget(self, channels: list[str], inbox: asyncio.Queue) -> list[str]:
        """Detach ``inbox``; the channels nobody listens to any more."""
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
        return gone

    async def _send_unsubscribe(self, names: list[str]) -> None:
        if not names:
            return
        try:
            async with self._lock:  # checked under the lock: a channel wanted again stays subscribed
                names = [name for name in names if name not in self._channels and name != self.reply_channel]
                if names:
                    await self._pubsub.unsubscribe(*names)
        except (RedisError, OSError) as e:  # a leftover subscription is dropped when it next gets a message
            log.warning("unsubscribe failed", extra={"channels": len(names), "error": str(e)})

    async def _drop_stale(self, name: str) -> None:
        try:
            await self._send_unsubscribe([name])
        finally:
            self._stale.discard(name)

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
        if name == self.reply_channel:
            self._dispatch_reply(kind, message["data"])
            return
        ch = self._channels.get(name)
        if ch is None:
            if kind == "message" and name not in self._stale:  # left over (re-subscribed on reconnect, ...)
                self._stale.add(name)
                self._spawn(self._drop_stale(name))
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
