"""One asyncio connection to Redis shared by every request of an API process, for the accept path.

redis-py's asyncio client spends ~150 µs of Python per pipelined round trip (a pooled connection taken and given
back under a lock, a health check, a retry wrapper, a timeout context per read; measured on the 2-core VM): two
round trips were ~40% of the CPU an accepted request cost. Here each call frames its commands with
``hiredis.pack_command`` and writes them at once; Redis answers a connection's commands in order, so the replies
are matched to callers first-in first-out, and concurrent callers share the connection (their writes coalesce).
A MULTI block is one write, so it never interleaves with another caller's commands.

On a lost connection every waiting call fails with ``redis.ConnectionError`` and is retried on a new connection
(backoff 50 ms doubling to 1 s, ~2.5 s in all), as the pooled client does: the API's writes are idempotent by
request id (see ``api.broker.resilient_client``).
"""

from __future__ import annotations

import asyncio
import collections
import time

import hiredis
from redis.connection import parse_url
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from worker.connection import handshake, tls_context

_MULTI, _EXEC = hiredis.pack_command(("MULTI",)), hiredis.pack_command(("EXEC",))


class Commands:
    """Commands for one round trip, recorded through the redis-py pipeline methods the queue contract calls
    (``QueuedRequest.enqueue``), so the contract keeps one way of saying what a request's submission writes."""

    def __init__(self) -> None:
        self.args: list[tuple] = []

    def zadd(self, name: str, mapping: dict) -> None:
        self.args.append(("ZADD", name, *(x for member, score in mapping.items() for x in (score, member))))

    def hset(self, name: str, mapping: dict) -> None:
        self.args.append(("HSET", name, *(x for kv in mapping.items() for x in kv)))

    def expire(self, name: str, seconds: int) -> None:
        self.args.append(("EXPIRE", name, int(seconds)))

    def xadd(self, name: str, fields: dict) -> None:
        self.args.append(("XADD", name, "*", *(x for kv in fields.items() for x in kv)))

    def xlen(self, name: str) -> None:
        self.args.append(("XLEN", name))


class _Protocol(asyncio.Protocol):
    def __init__(self, owner: PipelinedRedis):
        self.owner = owner
        self.reader = hiredis.Reader()
        self.transport: asyncio.Transport | None = None
        self.waiting: collections.deque[tuple[asyncio.Future, int, list]] = collections.deque()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while self.waiting and (reply := self.reader.gets()) is not False:
            future, count, replies = self.waiting[0]
            replies.append(reply)
            if len(replies) == count:
                self.waiting.popleft()
                if not future.done():
                    future.set_result(replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionError(f"redis connection lost: {exc!r}" if exc else "redis closed the connection"))

    def fail(self, error: Exception) -> None:
        if self.owner.protocol is self:
            self.owner.protocol = None
        while self.waiting:
            future = self.waiting.popleft()[0]
            if not future.done():
                future.set_exception(error)
        if self.transport is not None:
            self.transport.close()


class PipelinedRedis:
    def __init__(self, url: str, client_name: str, timeout_s: float = 10.0, connect_timeout_s: float = 5.0,
                 retry_budget_s: float = 2.5):
        self.options = parse_url(url)
        self.client_name = client_name
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry_budget_s = retry_budget_s
        self.protocol: _Protocol | None = None
        self._connecting: asyncio.Future | None = None

    async def execute(self, commands: list[tuple], transaction: bool = False) -> list:
        """The commands' replies, in one round trip (inside MULTI/EXEC with ``transaction``). An error reply
        raises ``ResponseError``; a connection that cannot be had raises ``ConnectionError`` after retries."""
        if not commands:
            return []
        delay, deadline = 0.05, time.monotonic() + self.retry_budget_s
        while True:
            try:
                return await self._round_trip(commands, transaction)
            except ConnectionError:  # not a timeout: the command may be running still
                if time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(1.0, 2 * delay)

    async def close(self) -> None:
        if self.protocol is not None:
            self.protocol.fail(ConnectionError("client closed"))

    async def _round_trip(self, commands: list[tuple], transaction: bool) -> list:
        protocol = self.protocol
        if protocol is not None and protocol.transport.is_closing():  # closed, its connection_lost still to come
            protocol.fail(ConnectionError("redis connection closing"))
            protocol = None
        protocol = protocol or await self._connect()
        blob = b"".join(hiredis.pack_command(cmd) for cmd in commands)
        count = len(commands)
        if transaction:
            blob, count = _MULTI + blob + _EXEC, count + 2
        future = asyncio.get_running_loop().create_future()
        protocol.waiting.append((future, count, []))
        protocol.transport.write(blob)
        timer = asyncio.get_running_loop().call_later(
            self.timeout_s, protocol.fail, TimeoutError(f"no reply from redis in {self.timeout_s} s"))
        try:
            replies = await future
        finally:
            timer.cancel()
        if transaction:
            replies = replies[-1]
            if isinstance(replies, hiredis.ReplyError):  # EXECABORT: a command was refused while queuing
                raise ResponseError(str(replies))
        for reply in replies:
            if isinstance(reply, hiredis.ReplyError):
                raise ResponseError(str(reply))
        return replies

    async def _connect(self) -> _Protocol:
        """One connection attempt at a time; concurrent callers wait for it."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if self._connecting is connecting and connecting.done():
                self._connecting = None

    async def _open(self) -> _Protocol:
        o, loop = self.options, asyncio.get_running_loop()
        try:
            if "path" in o:
                connect = loop.create_unix_connection(lambda: _Protocol(self), o["path"])
            else:
                connect = loop.create_connection(lambda: _Protocol(self), o.get("host", "localhost"),
                                                 o.get("port", 6379), ssl=tls_context(o))
            _, protocol = await asyncio.wait_for(connect, self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            raise ConnectionError(f"cannot connect to redis: {e!r}") from e
        self.protocol = protocol  # commands of other callers queue behind the hand-shake on the wire
        try:
            await self._round_trip(handshake(o, self.client_name), transaction=False)
        except ResponseError as e:
            protocol.fail(ConnectionError(f"redis refused the connection: {e}"))
            raise ConnectionError(f"redis refused the connection: {e}") from e
        return protocol
