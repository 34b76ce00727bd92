"""A recorded worker write (tests/data/writer_state.json) and how to replay it: the Redis state a scripted run
of the writer leaves — keys, stream entries, published messages — with times normalised away.

    python -m tests.writer_scenario record   # (re)write the recording with the current writer
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import orjson
import redis

from engine.sequence import SequenceOutput, TokenLogprob
from worker import contract as c
from worker.redis_server import RedisServer

RECORDING = Path(__file__).parent / "data" / "writer_state.json"
TIME_FIELDS = {"created", "finished", "timings", "started", "ts"}


def out(rid: str, index: int, token: int, text: str, finished: bool = False, logprobs: bool = False):
    lps = [TokenLogprob(token, -0.25, [(token, -0.25), (token + 1, -1.5)])] if logprobs else None
    return SequenceOutput(rid, index, [token], text, lps, finished, "length" if finished else None)


def scenario(r: redis.Redis, worker, ops) -> None:
    """Drive ``worker.io`` through a fixed run; ``ops`` builds the writer's operations (tuples or typed)."""
    from worker.results import InFlight
    reqs = [c.QueuedRequest(id="plain", prompt_token_ids=[1, 2], params={}, stream=True, created=1.0),
            c.QueuedRequest(id="multi", prompt_token_ids=[3], params={"logprobs": 1}, n=2, stream=True, created=1.0),
            c.QueuedRequest(id="async", prompt_token_ids=[4], params={}, stream=True, record_text=True, created=1.0),
            c.QueuedRequest(id="quiet", prompt_token_ids=[5], params={}, created=1.0),
            c.QueuedRequest(id="cut", prompt_token_ids=[6], params={}, stream=True, created=1.0)]
    pipe = r.pipeline()
    for req in reqs:
        req.enqueue(pipe)
    pipe.execute()
    stream = reqs[0].stream_key
    r.xgroup_create(stream, c.GROUP, id="0")
    entries = {c.QueuedRequest.decode(f).id: eid for eid, f in r.xreadgroup(c.GROUP, "rec", {stream: ">"})[0][1]}
    flights = {req.id: InFlight(req, stream, entries[req.id], received=1.0) for req in reqs}
    flights["async"].watched = True
    start = []
    for req in reqs:
        start += [ops.start(flights[req.id]),
                  ops.command("HSET", c.request_key(req.id), "status", "running", "worker", "rec"),
                  ops.publish(c.out_channel(req.id), c.status_message(req.id, "running"))]
    step1 = [out("plain", 0, 11, "a"), out("multi", 0, 21, "x", logprobs=True), out("multi", 1, 31, "p", logprobs=True),
             out("async", 0, 41, "m"), out("quiet", 0, 51, "q"), out("cut", 0, 61, "c")]
    step2 = [out("plain", 0, 12, "b"), out("multi", 0, 22, "y", logprobs=True),
             out("multi", 1, 32, "q", True, logprobs=True), out("async", 0, 42, "n"), out("quiet", 0, 52, "r", True),
             out("cut", 0, 62, "d")]
    step3 = [out("plain", 0, 13, "c", True), out("multi", 0, 23, "z", True, logprobs=True),
             out("async", 0, 43, "o", True)]
    now = 2.0
    worker.io.writer.write([start, [ops.outputs(step1, now)]])
    worker.io.writer.write([[ops.outputs(step2, now)], [ops.end(flights["cut"], ("cancelled", "cancelled by the client",
                                                                           "cancelled"))]])
    worker.io.writer.write([[ops.outputs(step3, now), ops.command("XADD", c.STREAM_DEAD, "*", "reason", "test")]])


def state(r: redis.Redis, messages: list) -> dict:
    keys = {}
    for key in sorted(k.decode() for k in r.keys("*")):
        kind = r.type(key).decode()
        if kind == "string":
            value = r.get(key)
            try:
                value = normalise(orjson.loads(value))
            except orjson.JSONDecodeError:
                value = value.decode()
        elif kind == "hash":
            value = {k.decode(): v.decode() for k, v in r.hgetall(key).items() if k.decode() not in TIME_FIELDS}
        elif kind == "stream":
            value = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(key)]
            value = [normalise(orjson.loads(v["data"])) if "data" in v else v for v in value]
        elif kind == "zset":
            value = [m.decode() for m in r.zrange(key, 0, -1)]
        else:
            value = kind
        keys[key] = {"type": kind, "ttl": r.ttl(key) > 0, "value": value}
    return {"keys": keys, "messages": messages}


def normalise(obj):
    if isinstance(obj, dict):
        return {k: normalise(v) for k, v in obj.items() if k not in TIME_FIELDS}
    if isinstance(obj, list):
        return [normalise(v) for v in obj]
    return obj


def run_scenario(ops) -> dict:
    """The state the current writer leaves after ``scenario`` on a fresh redis-server."""
    from worker.worker import Worker, WorkerConfig
    with tempfile.TemporaryDirectory() as tmp, RedisServer(tmp, appendonly=False) as server:
        r = redis.Redis.from_url(server.url)
        sub = r.pubsub()
        sub.psubscribe(c.PREFIX + "out:*")
        sub.get_message(timeout=1)
        worker = Worker(None, WorkerConfig(redis_url=server.url, name="rec"))
        scenario(r, worker, ops)
        time.sleep(0.2)
        messages = []
        while (msg := sub.get_message(timeout=0.5)) is not None:
            if msg["type"] == "pmessage":
                messages.append([msg["channel"].decode(), normalise(orjson.loads(msg["data"]))])
        return state(r, messages)


if __name__ == "__main__" and sys.argv[1:] == ["record"]:
    from tests.writer_ops import OPS
    RECORDING.write_text(json.dumps(run_scenario(OPS), indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORDING}")
