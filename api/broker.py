"""Everything the API does in Redis, by the queue contract (``worker/contract.py``)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, RedisError

from api.pipelined import Commands, PipelinedRedis
from api.pubsub import Multiplexer
from worker import contract as c
from worker.prefix_digests import PrefixDigests

log = logging.getLogger(__name__)

CLIENT_NAME = "gaggle-api"
PUBSUB_CLIENT_NAME = "gaggle-api-pubsub"  # the one subscriber connection of an API process (CLIENT LIST)
TENANTS_CACHE_S = 1.0  # how long the list of tenants (their streams) is reused for queue depths
DEPTHS_CACHE_S = 0.1  # how old the other tenants' queue depths may be at admission (the caller's are read anew)


# A burst of concurrent requests waits for a pooled connection instead of failing: redis-py's default pool
# raises "Too many connections" past 100 at once (redis 8), which made a 256-stream burst answer 503s.
POOL_CONNECTIONS = 256
POOL_WAIT_S = 20.0


def resilient_client(redis_url: str, name: str, **kwargs) -> aioredis.Redis:
    """A client that survives a Redis restart: a command on a stale pooled connection reconnects and is retried
    (backoff 50 ms doubling to 1 s, ~2.5 s in all, then the error), and idle connections are checked first.
    A retried write may run twice if Redis ran it and the reply was lost; every write here is idempotent by
    request id (or harmless twice: an XADD of the same request is a duplicate delivery the workers skip)."""
    pool = aioredis.BlockingConnectionPool.from_url(
        redis_url, max_connections=POOL_CONNECTIONS, timeout=POOL_WAIT_S, client_name=name, socket_connect_timeout=5,
        health_check_interval=5,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=6, supported_errors=(ConnectionError,)),
        **kwargs)
    return aioredis.Redis.from_pool(pool)


@dataclass
class Snapshot:
    """A request's stored state, read in one MULTI (with ``mark``: and a marker published on its channel)."""
    record: dict[str, str]
    result: c.Result | None
    texts: list[str]
    cancel_requested: bool
    mark: str


class Broker:
    def __init__(self, redis_url: str, worker_cache_s: float = 1.0):
        self.redis = resilient_client(redis_url, CLIENT_NAME, socket_timeout=10)
        self.pipelined = PipelinedRedis(redis_url, CLIENT_NAME)  # the accept path: admission reads, enqueue
        self._pubsub_client = resilient_client(redis_url, PUBSUB_CLIENT_NAME)
        # This process's lease: workers cancel its sync requests once it lapses (the process died).
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.channels = Multiplexer(self._pubsub_client, c.reply_channel(self.owner))
        self._worker_cache_s = worker_cache_s
        self._workers: list[c.Heartbeat] = []
        self._workers_at = -1e9
        self._workers_lock = asyncio.Lock()
        self._tenants: list[str] = []
        self._depths: dict[str, int] = {}
        self._depths_at = -1e9
        self._depths_lock = asyncio.Lock()
        self._tenants_at = -1e9
        self._background: set[asyncio.Task] = set()
        self._lease_task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.channels.start()
        self._lease_task = asyncio.create_task(self._keep_lease(), name="gaggle-api-lease")

    async def stop(self) -> None:
        if self._lease_task is not None:
            self._lease_task.cancel()
            await asyncio.gather(self._lease_task, return_exceptions=True)
        if self._background:
            await asyncio.wait(self._background, timeout=5.0)
        await self.channels.stop()
        await self._pubsub_client.aclose()
        await self.redis.aclose()
        await self.pipelined.close()

    async def _keep_lease(self) -> None:
        while True:
            try:
                await self.redis.set(c.owner_key(self.owner), 1, px=int(c.OWNER_TTL_S * 1000))
            except (RedisError, OSError) as e:
                log.warning("could not refresh the API lease", extra={"owner": self.owner, "error": str(e)})
            await asyncio.sleep(c.OWNER_REFRESH_S)

    # -- requests --------------------------------------------------------------------------

    async def enqueue(self, requests: list[c.QueuedRequest]) -> None:
        """Write each request's record, then add it to its tenant's stream (one MULTI), each marked with the
        worker that holds its prompt's prefix where one does (``routes``)."""
        prefer = await self.routes(requests)
        commands = Commands()
        for req in requests:
            req.enqueue(commands, prefer.get(req.id, ""))
        await self.pipelined.execute(commands.args, transaction=True)

    async def routes(self, requests: list[c.QueuedRequest]) -> dict[str, str]:
        """request id -> the live worker with room that advertises the longest prefix of its prompt (prompts of
        at least ROUTE_MIN_TOKENS from the zero state, with two or more workers live). A hint: any worker may
        still run it, and a Redis error means no preference."""
        long = [r for r in requests if len(r.prompt_token_ids) >= c.ROUTE_MIN_TOKENS and not r.params.get("state")]
        if not long:
            return {}
        try:
            live = await self.live_workers()
            if len(live) < 2:
                return {}
            room = {w.name for w in live if not w.draining and w.free_slots > 0}
            first = c.ROUTE_MIN_TOKENS // c.STATE_BLOCK
            keys, spans = [], []
            for req in long:
                digests = PrefixDigests(req.prompt_token_ids)
                blocks = range(len(req.prompt_token_ids) // c.STATE_BLOCK, first - 1, -1)  # longest first
                spans.append((req.id, len(keys), len(blocks)))
                keys += [c.held_key(digests.block(k)) for k in blocks]
            holders = await self.redis.mget(keys)
        except (RedisError, OSError) as e:
            log.warning("no prefix routing: redis unavailable", extra={"error": str(e)})
            return {}
        prefer = {}
        for rid, start, count in spans:
            for holder in holders[start:start + count]:
                name = holder.decode() if isinstance(holder, bytes) else holder
                if name in room:
                    prefer[rid] = name
                    break
        return prefer

    async def cancel(self, request_ids: list[str]) -> None:
        """Cancel marker (for requests not picked up yet) + abort message (for running ones)."""
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.set(c.cancel_key(rid), 1, ex=c.CANCEL_TTL_S)
            pipe.publish(c.CHANNEL_ABORTS, rid)
        await pipe.execute()

    def cancel_soon(self, request_ids: list[str], reason: str) -> None:
        """Cancel from code that may itself be cancelled (a disconnect): runs as its own task."""
        async def run() -> None:
            try:
                await self.cancel(request_ids)
                for rid in request_ids:
                    log.info("request cancelled", extra={"request_id": rid, "reason": reason})
            except RedisError:
                log.exception("could not cancel", extra={"request_ids": request_ids, "reason": reason})
        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def finals(self, request_ids: list[str]) -> tuple[dict[str, c.Result], list[str]]:
        """In one round trip: the results stored for these requests, and those with neither a result nor a record.
        Written with its stream entry in one MULTI and kept for a day, a record is gone only if Redis lost its
        data (restarted without persistence, flushed): nothing will ever answer such a request."""
        replies = await self.pipelined.execute([("MGET", *(c.result_key(rid) for rid in request_ids)),
                                                *(("EXISTS", c.request_key(rid)) for rid in request_ids)])
        results = {}
        for rid, data in zip(request_ids, replies[0]):
            if data:
                try:
                    results[rid] = c.Result.decode(data)
                except (c.SchemaError, TypeError) as e:
                    log.error("undecodable result", extra={"request_id": rid, "error": str(e)})
        lost = [rid for rid, data, exists in zip(request_ids, replies[0], replies[1:]) if not data and not exists]
        return results, lost

    async def record(self, request_id: str) -> dict[str, str]:
        raw = await self.redis.hgetall(c.request_key(request_id))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def snapshot(self, request_id: str, n: int, mark: bool = False) -> Snapshot:
        """Record, result, cancel marker and text so far; with ``mark``, also a marker on the channel."""
        token = uuid.uuid4().hex if mark else ""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(c.request_key(request_id))
        pipe.get(c.result_key(request_id))
        pipe.exists(c.cancel_key(request_id))
        for i in range(n):
            pipe.get(c.text_key(request_id, i))
        if mark:  # a watcher: from now on workers publish this request's deltas (see contract.watch_key)
            pipe.set(c.watch_key(request_id), 1, ex=c.WATCH_TTL_S)
            pipe.publish(c.out_channel(request_id), c.mark_message(request_id, token))
        raw_record, raw_result, cancelled, *texts = (await pipe.execute())[:3 + n]
        record = {k.decode(): v.decode() for k, v in raw_record.items()}
        result = c.Result.decode(raw_result) if raw_result else None
        return Snapshot(record, result, [(t or b"").decode("utf-8", "replace") for t in texts], bool(cancelled),
                        token)

    async def touch_watch(self, request_id: str) -> None:
        await self.redis.set(c.watch_key(request_id), 1, ex=c.WATCH_TTL_S)

    # -- cluster state ---------------------------------------------------------------------

    async def restarts(self) -> dict[str, int]:
        """How often ``gaggle up`` restarted each of its children."""
        raw = await self.redis.hgetall(c.RESTARTS)
        return {k.decode(): int(v) for k, v in raw.items()}

    async def live_workers(self) -> list[c.Heartbeat]:
        """Fresh heartbeats (cached for worker_cache_s; an empty list is not cached: a starting service is ready
        as soon as its first worker's heartbeat lands)."""
        async with self._workers_lock:
            now = time.monotonic()
            if not self._workers or now - self._workers_at >= self._worker_cache_s:
                self._workers = await self._read_heartbeats()
                self._workers_at = now
            return self._workers

    async def _read_heartbeats(self) -> list[c.Heartbeat]:
        # the heartbeat keys' TTLs decide who is alive
        return await self._read_registry(c.WORKER_REGISTRY, c.WORKER_REGISTRY_RETENTION_S, c.heartbeat_key,
                                         c.Heartbeat)

    async def _read_registry(self, registry: str, retention_s: float, key_of, message_type) -> list:
        """The messages under the keys of the names that ``registry`` (a zset name -> last report time) saw in
        the last ``retention_s`` seconds; expired keys are skipped, undecodable ones logged."""
        names = await self.redis.zrangebyscore(registry, time.time() - retention_s, "+inf")
        if not names:
            return []
        messages = []
        for data in await self.redis.mget([key_of(n.decode() if isinstance(n, bytes) else n) for n in names]):
            if data:  # expired between ZRANGEBYSCORE and MGET
                try:
                    messages.append(message_type.decode(data))
                except (c.SchemaError, TypeError) as e:
                    log.warning("undecodable registry entry", extra={"registry": registry, "error": str(e)})
        return messages

    async def warming_workers(self) -> list[c.WarmupStatus]:
        """Workers still warming up (fresh ``warming:<name>`` keys), oldest report first."""
        return await self._read_registry(c.WARMING_REGISTRY, c.WARMING_TTL_S, c.warming_key, c.WarmupStatus)

    async def tenants(self) -> list[str]:
        """Tenants that ever queued a request (their streams), cached for TENANTS_CACHE_S."""
        now = time.monotonic()
        if now - self._tenants_at >= TENANTS_CACHE_S:
            self._tenants = sorted(t.decode() for t in await self.redis.zrange(c.TENANTS, 0, -1))
            self._tenants_at = now
        return self._tenants

    async def queue_depth(self, tenant: str | None = None) -> dict[str, int]:
        """XLEN per request stream (every tenant's, or one tenant's): workers XDEL after XACK, so this is
        queued + in flight."""
        tenants = [tenant] if tenant is not None else await self.tenants()
        streams = [c.request_stream(p, t) for t in tenants for p in c.PRIORITIES]
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xlen(stream)
        depths = {}
        for stream, depth in zip(streams, await pipe.execute(raise_on_error=False)):
            if isinstance(depth, Exception):  # a key of another type where a stream belongs: that stream only
                log.error("not a request stream; skipped", extra={"key": stream, "error": str(depth)})
                continue
            depths[stream] = depth
        return depths

    async def admission_depths(self, tenant: str) -> tuple[int, int]:
        """(every stream's depth, the tenant's own) for admission: the tenant's own streams read now, the other
        tenants' from a snapshot at most DEPTHS_CACHE_S old (shared by concurrent callers). Two XLENs a request
        instead of two per tenant."""
        own_streams = [c.request_stream(p, tenant) for p in c.PRIORITIES]
        own = sum(await self.pipelined.execute([("XLEN", stream) for stream in own_streams]))
        async with self._depths_lock:
            now = time.monotonic()
            if now - self._depths_at >= DEPTHS_CACHE_S:
                self._depths = await self.queue_depth()
                self._depths_at = now
        others = sum(depth for stream, depth in self._depths.items() if stream not in own_streams)
        return others + own, own

    async def active_batches(self) -> list[dict]:
        """The batches not yet ended: id, status and request counts (the status page, /metrics)."""
        ids = sorted(b.decode() for b in await self.redis.smembers(c.BATCHES_ACTIVE))
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hmget(c.batch_key(batch_id), "status", "total", "completed", "failed", "created_at")
        out = []
        for batch_id, values in zip(ids, await pipe.execute()):
            status, total, done, failed, created = (v.decode() if v else None for v in values)
            if status:
                out.append({"id": batch_id, "status": status, "total": int(total or 0), "completed": int(done or 0),
                            "failed": int(failed or 0), "created_at": int(created or 0)})
        return out

    async def record_error(self, status: int, path: str, message: str) -> None:
        """Best effort: the status page's list of recent server-side errors (contract.RECENT_ERRORS)."""
        entry = c.dumps({"time": time.time(), "status": status, "path": path, "message": message[:300]})
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.lpush(c.RECENT_ERRORS, entry)
            pipe.ltrim(c.RECENT_ERRORS, 0, c.RECENT_ERRORS_KEPT - 1)
            await pipe.execute()
        except (RedisError, OSError):
            pass

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (RedisError, OSError):
            return False
