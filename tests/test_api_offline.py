"""The API with no worker consuming its queue: timeouts, 503, 429, a schema fuzz; plus pure helpers.

One API process on its own Redis database. A fake heartbeat stands in for a worker where
the API must believe one is alive; nothing ever takes entries off the stream.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import httpx
import openai
import orjson
import pytest

from api.auth import KeyStore, parse_keys_env, parse_keys_file
from api.errors import param_of
from api.prompts import render_chat
from api.schemas import ChatMessage
from api.settings import Settings
from tests.queue_helpers import REPO, request_streams
from tests.test_api_support import ApiServer, flushed, is_openai_error, wait_for
from worker import contract as c

MAX_QUEUE = 3
TIMEOUT_S = 4.0  # long enough for the polling test on a loaded machine
FAKE = "fake-worker"
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def offline(redis_server):
    url = redis_server.url.rsplit("/", 1)[0] + "/1"  # a database of its own
    r = flushed(url)
    set_fake_heartbeat(r)
    api = ApiServer(url, "--max-queue", str(MAX_QUEUE), "--request-timeout", str(TIMEOUT_S),
                    "--max-prompt-tokens", "1000", env={"GAGGLE_KEEPALIVE_S": "0.4", "GAGGLE_RESULT_POLL_S": "0.3",
                                                        "GAGGLE_MAX_BODY_BYTES": str(MAX_BODY),
                                                        "GAGGLE_MAX_SEQUENCES_PER_CALL": "8"})
    try:
        api.wait_healthy()
        api.r = r
        yield api
    finally:
        api.stop()
        r.flushdb()


@pytest.fixture(scope="module")
def client(offline):
    return openai.OpenAI(base_url=offline.url + "/v1", api_key="unused", max_retries=0, timeout=30)


DEFAULT_STREAM = c.request_stream("interactive", c.DEFAULT_TENANT)


def clear_queue(r) -> None:
    streams = request_streams(r)
    if streams:
        r.delete(*streams)


def set_fake_heartbeat(r) -> None:
    hb = c.Heartbeat(name=FAKE, pid=0, host="test", device="cpu", model="none", num_slots=1, running=0,
                     free_slots=1, tokens_per_s=0.0, started=time.time())
    pipe = r.pipeline()
    hb.publish(pipe)
    pipe.set(c.heartbeat_key(FAKE), hb.encode(), px=600_000)  # outlives the test, unlike a real worker's
    pipe.execute()


# -- no torch, pure helpers ----------------------------------------------------------------------

def test_import_api_main_leaves_torch_out():
    code = ("import sys, api.main, api.server, cli.main; api.main.create_app(); "
            "cli.main.build_parser().parse_args(['api']); assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_sampling_params_cross_the_wire_and_a_broken_limit_names_its_field():
    from engine.params import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, MAX_STRUCTURED_BYTES, ParamError, SamplingParams
    params = SamplingParams(max_tokens=5, min_tokens=2, logit_bias={7: -1.5}, stop="x", seed=3, logprobs=1,
                            structured={"type": "choice", "value": ["a", "b"]})
    assert SamplingParams.from_wire(orjson.loads(orjson.dumps(params.to_wire()))) == params
    assert "structured" not in SamplingParams().to_wire()  # a free request's entry carries no constraint
    big = {"type": "json_schema", "value": {"description": "x" * MAX_STRUCTURED_BYTES}}
    for fields, name in ((dict(temperature=2.5), "temperature"), (dict(top_p=0.0), "top_p"),
                         (dict(max_tokens=3, min_tokens=4), "min_tokens"),
                         (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"), (dict(seed=2**63), "seed"),
                         (dict(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
                         (dict(structured=big), "structured")):
        with pytest.raises(ParamError) as built:
            SamplingParams(**fields)
        with pytest.raises(ParamError) as decoded:  # a worker decoding an entry runs the same check
            SamplingParams.from_wire({**SamplingParams().to_wire(), **fields})
        assert built.value.field == decoded.value.field == name and str(built.value) == str(decoded.value)


def test_rwkv_chat_format_and_a_custom_template():
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi"),
                ChatMessage(role="assistant", content="Hello."), ChatMessage(role="user", content="Bye")]
    assert render_chat(messages, Settings(), True) == (
        "System: Be brief.\n\nUser: Hi\n\nAssistant: Hello.\n\nUser: Bye\n\nAssistant:")
    assert render_chat(messages[1:2], Settings(), False) == "User: Hi\n\n"
    custom = Settings(chat_user_template="<u>{content}</u>", chat_generation_prompt="<a>")
    assert render_chat(messages[1:2], custom, True) == "<u>Hi</u><a>"


def test_api_keys_from_file_and_env():
    pairs = parse_keys_file("# comment\n\nk1 tenantA\n  k2   tenantB \n") + parse_keys_env("k3:tenantC, k:4:D")
    assert pairs == [("k1", "tenantA"), ("k2", "tenantB"), ("k3", "tenantC"), ("k:4", "D")]
    store = KeyStore.of(pairs)
    assert store.tenant_for("k2") == "tenantB" and store.tenant_for("k") is None and store.tenant_for("") is None
    with pytest.raises(ValueError):
        parse_keys_file("only-a-key\n")
    with pytest.raises(ValueError):
        parse_keys_env("no-tenant")


def test_error_params_name_the_field():
    assert param_of(("body", "messages", 0, "content")) == "messages[0].content"
    assert param_of(("body", "prompt", "list[int]", 3)) == "prompt[3]"
    assert param_of(("body", "chat", "messages")) == "messages"
    assert param_of(("body",)) is None


def test_one_connection_multiplexes_shared_channels_and_drops_stale_ones(redis_server):
    import redis.asyncio as aioredis

    from api.pubsub import Multiplexer
    url = redis_server.url.rsplit("/", 1)[0] + "/2"
    message = c.status_message("x", "running")

    async def scenario():
        publisher = aioredis.Redis.from_url(url)
        mux = Multiplexer(aioredis.Redis.from_url(url), c.reply_channel("test-api"))
        await mux.start()
        r1, r2 = asyncio.Queue(), asyncio.Queue()
        await mux.route(["r1"], r1)
        await mux.route(["r2"], r2)  # one PUBLISH on the reply channel, routed by request id, a bad part skipped
        one = b"\n".join([c.status_message("r1", "running"), b"{not json", c.status_message("r2", "running"),
                          c.delta_message("r1", [{"index": 0, "text": "x", "token_ids": [1]}])])
        assert await publisher.publish(c.reply_channel("test-api"), one) == 1
        assert [(await asyncio.wait_for(r1.get(), 5))["type"] for _ in range(2)] == ["status", "delta"]
        assert (await asyncio.wait_for(r2.get(), 5))["id"] == "r2" and r2.empty()
        mux.unroute(["r1"], r1)
        await publisher.publish(c.reply_channel("test-api"), c.status_message("r1", "running"))
        await publisher.publish(c.reply_channel("test-api"), c.status_message("r2", "running"))
        await asyncio.wait_for(r2.get(), 5)
        assert r1.empty() and mux.num_routes == 1
        a, b = asyncio.Queue(), asyncio.Queue()
        await mux.subscribe(["ch1"], a)
        await mux.subscribe(["ch1", "ch2"], b)  # confirmed on return: a publish now reaches both
        assert await publisher.publish("ch1", message) == 1  # one subscriber connection for both readers
        assert (await asyncio.wait_for(a.get(), 5))["status"] == (await asyncio.wait_for(b.get(), 5))["status"]
        await mux.unsubscribe(["ch1"], a)
        await publisher.publish("ch1", message)
        await asyncio.wait_for(b.get(), 5)
        assert a.empty()
        await mux.unsubscribe(["ch1", "ch2"], b)
        assert await publisher.pubsub_numsub("ch1", "ch2") == [(b"ch1", 0), (b"ch2", 0)]
        assert (await publisher.pubsub_numsub(c.reply_channel("test-api")))[0][1] == 1  # the reply channel stays
        await mux._pubsub.subscribe("ghost")  # e.g. re-subscribed by a reconnect, nobody reads it
        await publisher.publish("ghost", message)
        for _ in range(100):
            if (await publisher.pubsub_numsub("ghost"))[0][1] == 0:
                break
            await asyncio.sleep(0.02)
        assert (await publisher.pubsub_numsub("ghost"))[0][1] == 0
        await mux.stop()
        await publisher.aclose()

    asyncio.run(scenario())


def test_enqueues_piling_up_while_redis_stalls_wait_for_a_connection(redis_server):
    """Redis stalls for 1.5 s (a busy script: like a fork or a slow disk) while 300 requests are being queued:
    they wait for a pooled connection instead of failing past the pool's default size (100 in redis-py 8:
    'Too many connections', which the API answered 503 queue_unavailable)."""
    import redis.asyncio as aioredis

    from api.broker import Broker
    url = redis_server.url.rsplit("/", 1)[0] + "/5"
    stall = ("local s = redis.call('TIME') local t0 = s[1] * 1e6 + s[2] "
             "while true do local n = redis.call('TIME') if n[1] * 1e6 + n[2] - t0 > 1500000 then break end end "
             "return 1")

    async def scenario() -> list:
        broker = Broker(url)
        await broker.start()
        other = aioredis.Redis.from_url(url)
        stalled = asyncio.create_task(other.eval(stall, 0))
        await asyncio.sleep(0.1)
        reqs = [c.QueuedRequest(id=f"stall-{i}", prompt_token_ids=[1, 2], params={"max_tokens": 1}) for i in range(300)]
        outcomes = await asyncio.gather(*[broker.enqueue([req]) for req in reqs], return_exceptions=True)
        await stalled
        queued = await other.xlen(reqs[0].stream_key)
        await other.flushdb()
        await other.aclose()
        await broker.stop()
        return [o for o in outcomes if o is not None], queued

    errors, queued = asyncio.run(scenario())
    assert errors == [] and queued == 300, errors[:3]


# -- the server without a worker ---------------------------------------------------------------

def test_request_timeout_cancels_and_answers_504(offline, client):
    clear_queue(offline.r)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="rwkv-7", prompt="hello", max_tokens=4)
    assert e.value.status_code == 504 and e.value.body["type"] == "timeout"
    with httpx.stream("POST", offline.url + "/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert ": keep-alive" in lines  # while nothing else comes
    assert lines[-1] == "data: [DONE]" and orjson.loads(lines[-2][6:])["error"]["type"] == "timeout"
    queued = [c.QueuedRequest.decode(fields) for _, fields in offline.r.xrange(DEFAULT_STREAM)]
    assert len(queued) == 2 and all(offline.r.exists(c.cancel_key(q.id)) for q in queued)  # a worker would skip them
    assert all(q.deadline <= time.time() + 60 for q in queued)


def test_a_missed_final_message_is_found_by_polling(offline, client):
    """A worker whose PUBLISH was lost (pub/sub reconnect): the API still finds the stored result."""
    clear_queue(offline.r)
    answer = {}
    thread = threading.Thread(target=lambda: answer.update(r=client.completions.create(model="rwkv-7", prompt="hello")))
    thread.start()
    entry = wait_for(lambda: offline.r.xrange(DEFAULT_STREAM), 10, 0.01, "the queued request")
    req = c.QueuedRequest.decode(entry[0][1])
    result = c.Result(id=req.id, status=c.STATUS_COMPLETED, choices=[c.Choice(0, "from the result key", [11, 12],
                                                                              "length")],
                      prompt_tokens=1, completion_tokens=2)
    offline.r.set(c.result_key(req.id), result.encode())  # no PUBLISH
    thread.join(timeout=30)
    assert answer["r"].choices[0].text == "from the result key" and answer["r"].usage.completion_tokens == 2


def test_a_request_redis_lost_fails_at_the_next_poll_not_at_its_timeout(offline, client):
    """Redis restarted without its data (here: the request's record and entry deleted while it waits): the
    caller gets a 500 it can retry within a poll or two, and a stream its error event, not a 504 after the
    request timeout."""
    def lose_the_queued_request() -> None:
        entry = wait_for(lambda: offline.r.xrange(DEFAULT_STREAM), 10, 0.01, "the queued request")
        rid = c.QueuedRequest.decode(entry[0][1]).id
        offline.r.delete(c.request_key(rid), DEFAULT_STREAM)

    for stream in (False, True):
        clear_queue(offline.r)
        loser = threading.Thread(target=lose_the_queued_request)
        loser.start()
        t0 = time.monotonic()
        if stream:
            with httpx.stream("POST", offline.url + "/v1/completions", timeout=30,
                              json={"prompt": "hello", "max_tokens": 4, "stream": True}) as resp:
                lines = [line for line in resp.iter_lines() if line]
            error = orjson.loads(lines[-2][6:])["error"]
            assert lines[-1] == "data: [DONE]" and error["code"] == "request_lost"
        else:
            with pytest.raises(openai.InternalServerError) as e:
                client.completions.create(model="rwkv-7", prompt="hello", max_tokens=4)
            assert e.value.status_code == 500 and e.value.body["code"] == "request_lost"
        assert time.monotonic() - t0 < TIMEOUT_S - 1  # the request timeout would answer 504 at TIMEOUT_S
        loser.join(timeout=10)


def test_merged_deltas_stream_their_tokens_in_order(offline):
    """A worker whose write covered several steps publishes several tokens of a choice in one delta: the
    client gets them in order, with a logprob per token, and nothing twice at the final."""
    clear_queue(offline.r)
    got = {}

    def stream():
        with httpx.stream("POST", offline.url + "/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 3, "stream": True, "logprobs": 1}) as resp:
            got["lines"] = [line for line in resp.iter_lines() if line]

    thread = threading.Thread(target=stream)
    thread.start()
    entry = wait_for(lambda: offline.r.xrange(DEFAULT_STREAM), 10, 0.01, "the queued request")
    req = c.QueuedRequest.decode(entry[0][1])
    rid, channel = req.id, c.channel_of(req)
    assert channel == req.reply_to != ""  # a sync request's messages go to its API process's reply channel

    def lp(token: int) -> dict:
        return {"token_id": token, "logprob": -0.5, "top": [[token, -0.5]]}

    result = c.Result(id=rid, choices=[c.Choice(0, "abc", [65, 66, 67], "length")], prompt_tokens=1,
                      completion_tokens=3)
    pipe = offline.r.pipeline()
    pipe.publish(channel, b"\n".join([  # as a worker's write: several messages in one PUBLISH
        c.status_message(rid, c.STATUS_RUNNING),
        c.delta_message(rid, [{"index": 0, "text": "ab", "token_ids": [65, 66], "logprobs": [lp(65), lp(66)]}])]))
    pipe.publish(channel, c.delta_message(rid, [{"index": 0, "text": "c", "token_ids": [67], "logprobs": [lp(67)],
                                                 "finish_reason": "length", "stop_reason": None}]))
    pipe.set(c.result_key(rid), result.encode())
    pipe.publish(channel, c.final_message(rid, result.encode()))
    pipe.execute()
    thread.join(timeout=30)
    chunks = [orjson.loads(line[6:]) for line in got["lines"] if line.startswith("data: {")]
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    assert [ch["text"] for ch in choices] == ["ab", "c"]
    assert [len(ch["logprobs"]["tokens"]) for ch in choices] == [2, 1]
    assert [ch["finish_reason"] for ch in choices] == [None, "length"] and got["lines"][-1] == "data: [DONE]"


def stream_lines_of_a_scripted_request(offline, messages) -> list[str]:
    """Stream one completion while this test plays the worker: ``messages(rid)`` are published on its channel."""
    clear_queue(offline.r)
    got = {}

    def stream():
        with httpx.stream("POST", offline.url + "/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 8, "stream": True}) as resp:
            got["lines"] = [line for line in resp.iter_lines() if line]

    thread = threading.Thread(target=stream)
    thread.start()
    entry = wait_for(lambda: offline.r.xrange(DEFAULT_STREAM), 10, 0.01, "the queued request")
    req = c.QueuedRequest.decode(entry[0][1])
    rid = req.id
    pipe = offline.r.pipeline()
    for msg in messages(rid):
        if isinstance(msg, c.Result):
            pipe.set(c.result_key(rid), msg.encode())
            pipe.publish(c.channel_of(req), c.final_message(rid, msg.encode()))
        else:
            pipe.publish(c.channel_of(req), msg)
    pipe.execute()
    thread.join(timeout=30)
    return got["lines"]


def scripted(rid: str, final_text: str) -> list:
    """Deltas "ab" (offset 0), then "fg" at offset 5: the three characters between were lost."""
    return [c.status_message(rid, c.STATUS_RUNNING),
            c.delta_message(rid, [{"index": 0, "text": "ab", "token_ids": [1, 2], "offset": 0, "text_offset": 0}]),
            c.delta_message(rid, [{"index": 0, "text": "fg", "token_ids": [6, 7], "offset": 5, "text_offset": 5}]),
            c.Result(id=rid, choices=[c.Choice(0, final_text, list(range(1, 9)), "length")], prompt_tokens=1,
                     completion_tokens=8)]


def test_a_gap_in_the_deltas_is_filled_from_the_result(offline):
    lines = stream_lines_of_a_scripted_request(offline, lambda rid: scripted(rid, "abcdefgh"))
    chunks = [orjson.loads(line[6:]) for line in lines if line.startswith("data: {")]
    texts = [ch["choices"][0]["text"] for ch in chunks if ch["choices"]]
    assert "".join(texts) == "abcdefgh" and texts[0] == "ab"  # "fg" held back: it came after a gap
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and lines[-1] == "data: [DONE]"


def test_a_stream_that_cannot_be_reconciled_ends_with_an_error(offline):
    lines = stream_lines_of_a_scripted_request(offline, lambda rid: scripted(rid, "xyzdefgh"))
    bodies = [orjson.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert is_openai_error(bodies[-1]) and bodies[-1]["error"]["code"] == "stream_inconsistent"
    assert all(b.get("choices", [{}])[0].get("finish_reason") is None for b in bodies[:-1])


def test_bad_input_is_a_4xx_and_the_connection_stays_usable(offline):
    with httpx.Client(base_url=offline.url, timeout=30) as http:
        bias = http.post("/v1/completions", json={"prompt": "x", "logit_bias": {"²": 1}})
        assert bias.status_code == 400 and bias.json()["error"]["param"] == "logit_bias"
        big = http.post("/v1/completions", json={"prompt": "x" * MAX_BODY})
        assert big.status_code == 413 and is_openai_error(big.json())
        chunked = http.post("/v1/completions", content=(b"x" * 4096 for _ in range(MAX_BODY // 4096 + 2)),
                            headers={"Content-Type": "application/json"})  # no Content-Length
        assert chunked.status_code == 413 and is_openai_error(chunked.json())
        many = http.post("/v1/completions", json={"prompt": ["a"] * 9})  # 9 > 8 sequences
        assert many.status_code == 400 and many.json()["error"]["code"] == "too_many_sequences"
        empty = http.post("/v1/chat/completions", json={"messages": [{"role": "user"}]})  # as OpenAI: content needed
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages[0].content", empty.json()
        calls = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "f", "arguments": "{}"}}]}
        assert http.post("/tokenize", json={"messages": [calls, {"role": "tool", "tool_call_id": "c",
                                                                  "content": "1"}]}).status_code == 200
        assert http.get("/health").status_code == 200  # the same keep-alive connection


def test_an_unexpected_error_is_a_500_error_object_and_the_connection_stays_open():
    import uvicorn
    from fastapi import FastAPI

    from api.middleware import CatchAll
    from worker.redis_server import free_port

    app = FastAPI()
    app.add_middleware(CatchAll)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    @app.get("/fine")
    async def fine():
        return {"ok": True}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 10, 0.01, "uvicorn")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            bad = http.get("/boom")
            assert bad.status_code == 500 and is_openai_error(bad.json())
            assert http.get("/fine").json() == {"ok": True}
            assert http.get("/boom").status_code == 500 and http.get("/fine").status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_no_live_worker_is_503_and_not_ready(offline, client):
    clear_queue(offline.r)
    offline.r.delete(c.heartbeat_key(FAKE))
    try:
        ready = wait_for(lambda: (r := httpx.get(offline.url + "/ready")).status_code == 503 and r, 10, 0.1,
                         "ready to say 503")
        assert is_openai_error(ready.json())
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model="rwkv-7", messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
        assert httpx.get(offline.url + "/health").status_code == 200  # liveness does not need a worker
    finally:
        set_fake_heartbeat(offline.r)
    wait_for(lambda: httpx.get(offline.url + "/ready").status_code == 200, 10, 0.1, "ready again")


def fill_queue(r) -> None:
    r.zadd(c.TENANTS, {c.DEFAULT_TENANT: time.time()})
    while r.xlen(DEFAULT_STREAM) < MAX_QUEUE:
        r.xadd(DEFAULT_STREAM, {c.ENTRY_FIELD: b"{}"})


def test_full_queue_is_429_with_retry_after(offline, client):
    fill_queue(offline.r)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="rwkv-7", prompt="hello", max_tokens=4)
    assert e.value.response.headers["retry-after"] and e.value.body["type"] == "rate_limit_error"
    resp = httpx.post(offline.url + "/v1/requests", json={"endpoint": "completions", "prompt": "x"})
    assert resp.status_code == 429 and is_openai_error(resp.json())
    bad = httpx.post(offline.url + "/v1/completions", json={"prompt": "x", "top_p": 0})  # validation comes first
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"


def test_other_tenants_queued_requests_count_toward_the_full_queue(offline):
    """Admission reads the caller's own streams anew and the other tenants' from a snapshot (≤ 0.1 s old, the
    tenant list ≤ 1 s): another tenant's backlog alone fills the queue."""
    clear_queue(offline.r)
    other = c.request_stream("interactive", "tenant-x")
    offline.r.zadd(c.TENANTS, {"tenant-x": time.time()})
    for _ in range(MAX_QUEUE):
        offline.r.xadd(other, {c.ENTRY_FIELD: b"{}"})
    from api.broker import DEPTHS_CACHE_S, TENANTS_CACHE_S

    def answer() -> int:
        return httpx.post(offline.url + "/v1/requests", json={"endpoint": "completions", "prompt": "x"}).status_code

    try:
        time.sleep(TENANTS_CACHE_S + 0.2)  # the API's tenant list and depths are stale by now: read anew
        assert answer() == 429  # the first request already: only tenant-x's entries are queued
        offline.r.delete(other)
        time.sleep(DEPTHS_CACHE_S + 0.1)
        assert answer() == 202
    finally:
        offline.r.delete(other)
        offline.r.zrem(c.TENANTS, "tenant-x")
        clear_queue(offline.r)


def test_fuzzed_requests_never_get_a_5xx_and_4xx_are_openai_errors(offline):
    """Schemathesis (v4) generates valid and invalid requests for every operation of the OpenAPI schema.

    The queue is full here, so valid generation requests end in 429 (after all validation) and
    nothing is generated; every other answer comes from validation, auth or lookups.
    """
    import hypothesis
    import schemathesis
    from hypothesis import strategies as st

    fill_queue(offline.r)
    schema = schemathesis.openapi.from_url(offline.url + "/openapi.json")
    strategies = [result.ok().as_strategy(generation_mode=mode)
                  for result in schema.get_all_operations()
                  for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)]
    seen: dict[int, int] = {}

    @hypothesis.settings(max_examples=400, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(case=st.one_of(strategies))
    def check(case):
        response = case.call(base_url=offline.url, timeout=10)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        where = f"{case.method} {case.formatted_path} {case.body!r:.300}"
        assert response.status_code < 500, f"{where} -> {response.status_code} {response.text[:300]}"
        if response.status_code >= 400:
            assert is_openai_error(response.json()), f"{where} -> {response.text[:300]}"

    started = time.monotonic()
    check()
    assert time.monotonic() - started < 60
    assert seen.get(400, 0) > 20 and seen.get(429, 0) > 5 and seen.get(404, 0) > 5, seen
    assert "Traceback" not in offline.log(1_000_000), offline.log()
