"""The API's shared pipelined Redis connection (api/pipelined.py) against a real redis-server: a request's
submission writes what redis-py's pipeline writes, concurrent callers get their own replies, errors surface, and a
restarted Redis is reconnected to."""

from __future__ import annotations

import asyncio

import pytest
import redis
from redis.exceptions import ConnectionError, ResponseError

from api.pipelined import Commands, PipelinedRedis
from worker import contract as c
from worker.redis_server import RedisServer


def queued(rid: str, tenant: str = "t1") -> c.QueuedRequest:
    return c.QueuedRequest(id=rid, prompt_token_ids=[1, 2, 3], params={"max_tokens": 4}, tenant=tenant)


def state(client: redis.Redis, rid: str, tenant: str) -> tuple:
    key = c.request_key(rid)
    entries = client.xrange(queued(rid, tenant).stream_key)
    return (client.hgetall(key), client.ttl(key) > 0, client.zscore(c.TENANTS, tenant) is not None,
            [fields for _, fields in entries])


def test_submission_writes_what_a_redis_py_pipeline_writes(redis_url):
    client = redis.Redis.from_url(redis_url)
    a, b = queued("req-a"), queued("req-b", tenant="t2")
    b.created, b.deadline = a.created, a.deadline  # the records differ by id and tenant only

    pipe = client.pipeline(transaction=True)
    a.enqueue(pipe)
    pipe.execute()

    async def ours():
        fast = PipelinedRedis(redis_url, "test")
        commands = Commands()
        b.enqueue(commands)
        replies = await fast.execute(commands.args, transaction=True)
        await fast.close()
        return replies

    replies = asyncio.run(ours())
    assert len(replies) == 4 and replies[-1].count(b"-") == 1  # ZADD, HSET, EXPIRE, XADD's entry id
    record_a, ttl_a, tenant_a, entries_a = state(client, "req-a", "t1")
    record_b, ttl_b, tenant_b, entries_b = state(client, "req-b", "t2")
    assert {**record_a, b"tenant": b"t2"} == record_b and ttl_a and ttl_b and tenant_a and tenant_b
    decoded_a, decoded_b = (c.QueuedRequest.decode(e[0]) for e in (entries_a, entries_b))
    assert (decoded_a.prompt_token_ids, decoded_a.params) == (decoded_b.prompt_token_ids, decoded_b.params)


def test_concurrent_callers_get_their_own_replies(redis_url):
    async def run():
        fast = PipelinedRedis(redis_url, "test")
        replies = await asyncio.gather(*[fast.execute([("INCRBY", f"k{i}", i), ("GET", f"k{i}")],
                                                      transaction=i % 2 == 0) for i in range(500)])
        await fast.close()
        return replies

    for i, (incr, got) in enumerate(asyncio.run(run())):
        assert incr == i and got == str(i).encode()


def test_error_replies_raise_and_the_connection_stays_usable(redis_url):
    redis.Redis.from_url(redis_url).set("a-string", "x")

    async def run():
        fast = PipelinedRedis(redis_url, "test")
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await fast.execute([("XLEN", "a-string")])
        with pytest.raises(ResponseError):  # refused while queuing: EXECABORT, nothing ran
            await fast.execute([("SET", "b", "1"), ("NOSUCHCOMMAND",)], transaction=True)
        assert await fast.execute([("EXISTS", "b"), ("PING",)]) == [0, b"PONG"]
        await fast.close()

    asyncio.run(run())


def test_a_restarted_redis_is_reconnected_to(tmp_path):
    server = RedisServer(tmp_path / "r").start()

    async def run():
        fast = PipelinedRedis(server.url, "test", retry_budget_s=5.0)
        assert await fast.execute([("SET", "k", "1")]) == [b"OK"]
        server.kill()
        with pytest.raises(ConnectionError):  # nobody there for the whole retry budget
            await PipelinedRedis(server.url, "other", retry_budget_s=0.2).execute([("PING",)])
        loop = asyncio.get_running_loop()
        restart = loop.run_in_executor(None, server.start)
        replies = await fast.execute([("INCR", "k")])  # retried until the server is back (AOF kept k)
        await restart
        await fast.close()
        return replies

    try:
        assert asyncio.run(run()) == [2]
    finally:
        server.stop()


def test_no_commands_no_round_trip(redis_url):
    async def run():
        fast = PipelinedRedis(redis_url, "test", timeout_s=0.5)
        assert await fast.execute([]) == [] and await fast.execute([], transaction=True) == []
        assert fast.protocol is None  # nothing was sent: no connection either
    asyncio.run(run())
