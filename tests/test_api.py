"""The API end to end: the official openai SDK and raw HTTP against `gaggle api` + a real worker + real Redis.

One worker process (tiny random model, CPU) and one API process serve the whole module.
The model's text is gibberish, but greedy decoding is deterministic, so it is compared
with the engine run in this process on the same weights.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
import uuid
from dataclasses import dataclass

import httpx
import openai
import orjson
import pytest
import redis

from tests.queue_helpers import heartbeat, log_of, start_worker
from tests.test_api_support import ApiServer, flushed, is_openai_error, sse_data, wait_for, wait_heartbeat
from worker import contract as c

WORKER = "api-test-worker"
NUM_SLOTS = 8
KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"
MODEL = "tiny-rwkv"
MAX_PROMPT_TOKENS = 300
PROMPT = "The quick brown fox"


@dataclass
class Stack:
    redis_url: str
    r: redis.Redis
    api: ApiServer
    worker: object


@pytest.fixture(scope="module")
def stack(redis_server, tiny_model_path, tmp_path_factory):
    r = flushed(redis_server.url)
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# key tenant\n{KEY_A} tenant-a\n")
    worker = start_worker(redis_server.url, str(tiny_model_path), WORKER, "--max-num-seqs", str(NUM_SLOTS))
    api = ApiServer(redis_server.url, "--api-keys-file", str(keys), "--model-name", MODEL,
                    "--max-prompt-tokens", str(MAX_PROMPT_TOKENS), env={"GAGGLE_API_KEYS": f"{KEY_B}:tenant-b"})
    try:
        api.wait_healthy()
        wait_heartbeat(r, WORKER)
        yield Stack(redis_server.url, r, api, worker)
    finally:
        api.stop()
        worker.terminate()
        try:
            worker.wait(timeout=40)
        except Exception:
            worker.kill()
        r.flushdb()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.api.url + "/v1", api_key=KEY_A, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.api.url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=120) as h:
        yield h


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    return LLMEngine(EngineConfig(device="cpu", model=str(tiny_model_path), max_num_seqs=32))


def engine_greedy(engine, prompt_ids: list[int], max_tokens: int, **params) -> tuple[str, list[int], str]:
    """Text, tokens and finish reason of a greedy run in this process (the reference)."""
    from engine.params import SamplingParams
    from engine.sequence import Request
    engine.add(Request(f"ref-{uuid.uuid4().hex}", list(prompt_ids),
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)))
    text, ids, finish = "", [], None
    while engine.has_work():
        for out in engine.step():
            text += out.text
            ids += out.token_ids
            finish = out.finish_reason if out.finished else finish
    return text, ids, finish


# -- correctness against the engine -----------------------------------------------------------

def test_greedy_completion_equals_the_engine(client, engine):
    ids = engine.tokenizer.encode(PROMPT)
    ref_text, ref_ids, ref_finish = engine_greedy(engine, ids, 24)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert r.choices[0].text == ref_text
    assert r.choices[0].finish_reason == ref_finish
    assert r.usage.completion_tokens == len(ref_ids) and r.usage.prompt_tokens == len(ids)
    assert r.usage.total_tokens == len(ids) + len(ref_ids)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)  # token-id prompt
    assert by_ids.choices[0].text == ref_text


def test_a_repeated_prompt_reports_its_cached_tokens_and_answers_the_same(client):
    ids = list(range(3000, 3040))  # 40 tokens: past the worker's 32-token minimum for a prefix state
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    longer = client.completions.create(model=MODEL, prompt=ids + [77, 78], max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 40 and again.choices[0].text == first.choices[0].text
    assert longer.usage.prompt_tokens_details.cached_tokens == 40 and longer.usage.prompt_tokens == 42


def test_streaming_with_usage_equals_non_streaming(client, engine):
    ref_text, ref_ids, _ = engine_greedy(engine, engine.tokenizer.encode(PROMPT), 16)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(ch.object == "text_completion" and ch.id == chunks[0].id for ch in chunks)
    *text_chunks, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == len(ref_ids)
    assert "".join(ch.choices[0].text for ch in text_chunks) == ref_text
    assert text_chunks[-1].choices[0].finish_reason is not None
    assert all(ch.choices[0].finish_reason is None for ch in text_chunks[:-1])


def test_sse_framing(http):
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(resp.iter_raw())
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
    assert all(f.startswith(b"data: {") for f in frames[:-2])


def test_chat_completion_sync_and_stream(client, engine):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    prompt = "System: You are terse.\n\nUser: Hi there\n\nAssistant:"
    ids = engine.tokenizer.encode(prompt)
    ref_text, ref_ids, _ = engine_greedy(engine, ids, 12, stop=["\n\nUser:"])
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref_text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref_text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref_ids)


def test_n_and_a_list_of_prompts(client, engine):
    r = client.completions.create(model=MODEL, prompt=["Hello", "World"], n=2, max_tokens=6, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(["Hello", "World"]):
        ref_text, _, _ = engine_greedy(engine, engine.tokenizer.encode(prompt), 6)
        assert r.choices[2 * p].text == r.choices[2 * p + 1].text == ref_text  # greedy: both choices alike
    sampled = client.completions.create(model=MODEL, prompt="Hello", n=2, max_tokens=6, temperature=1, seed=7)
    assert len(sampled.choices) == 2 and sampled.usage.completion_tokens == 12
    streamed = list(client.completions.create(model=MODEL, prompt=["Hello", "World"], n=2, max_tokens=6,
                                              temperature=0, stream=True))
    texts = {i: "".join(ch.choices[0].text for ch in streamed if ch.choices[0].index == i) for i in range(4)}
    assert [texts[i] for i in range(4)] == [ch.text for ch in r.choices]


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) >= 12
    stop = full[6:9]
    cut = full.index(stop)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:cut + len(stop)]


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text or r.choices[0].finish_reason == "stop"
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for item in content:
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
        assert len(item.top_logprobs) == 2 and item.logprob == pytest.approx(item.top_logprobs[0].logprob)


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_unknown_fields_are_ignored_and_echo_prepends_the_prompt(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                  extra_body={"no_such_field": [1, 2], "best_of_luck": True})
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)


def engine_prompt_logprobs(engine, prompt_ids: list[int], k: int) -> list:
    """The engine's prompt logprobs for ``prompt_ids`` (the reference for echo + logprobs)."""
    from engine.params import SamplingParams
    from engine.sequence import Request
    engine.add(Request(f"ref-{uuid.uuid4().hex}", list(prompt_ids),
                       SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k)))
    entries = None
    while engine.has_work():
        for out in engine.step():
            entries = out.prompt_logprobs if out.prompt_logprobs is not None else entries
    return entries


def test_echo_with_logprobs_scores_the_prompt(client, http, engine):
    """What evaluation harnesses send for log-likelihoods (echo, logprobs, a token or so): the prompt's tokens
    with their logprobs (the first null) before the generated ones, streamed or not."""
    ids = engine.tokenizer.encode(PROMPT)
    expected = engine_prompt_logprobs(engine, ids, 2)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + r.usage.completion_tokens
    assert "".join(lp.tokens[:len(ids)]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for got, want in zip(lp.token_logprobs[1:len(ids)], expected[1:]):
        assert got == pytest.approx(want.logprob, abs=1e-4)
    for top, want in zip(lp.top_logprobs[1:len(ids)], expected[1:]):
        assert 2 <= len(top) <= 3 and {engine.tokenizer.decode([i]) for i, _ in want.top} <= set(top)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = sse_data(http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                          "temperature": 0, "echo": True, "logprobs": 2,
                                                          "stream": True}))
    echoed = chunks[0]["choices"][0]
    assert echoed["text"] == PROMPT and echoed["logprobs"]["tokens"] == lp.tokens[:len(ids)]
    assert echoed["logprobs"]["token_logprobs"] == pytest.approx(lp.token_logprobs[:len(ids)], abs=1e-6)
    streamed = [t for ch in chunks if isinstance(ch, dict) and ch["choices"]
                for t in (ch["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    assert streamed == lp.text_offset


# -- errors ---------------------------------------------------------------------------------

def test_errors_raise_the_sdk_exceptions(client, stack, http):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=5)
    assert e.value.body["param"] == "temperature" and "2" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=list(range(1, MAX_PROMPT_TOKENS + 2)), max_tokens=2)
    assert str(MAX_PROMPT_TOKENS + 1) in e.value.body["message"] and str(MAX_PROMPT_TOKENS) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, n=NUM_SLOTS + 1)  # more than a worker can run
    assert e.value.body["param"] == "n" and str(NUM_SLOTS) in e.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.api.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    for body, content_type in ((b"{not json", "application/json"), (b"[1, 2]", "application/json"),
                               (b"", "application/json"), (b"prompt=x", "application/x-www-form-urlencoded")):
        resp = http.post("/v1/completions", content=body, headers={"Content-Type": content_type})
        assert resp.status_code == 400 and is_openai_error(resp.json()), (body, resp.text)
    resp = httpx.post(stack.api.url + "/v1/completions", json={"prompt": "x"})  # no key at all
    assert resp.status_code == 401 and is_openai_error(resp.json())


# -- async requests, tenancy -------------------------------------------------------------------

def poll(http: httpx.Client, rid: str, until=c.TERMINAL_STATUSES, timeout_s: float = 60.0) -> dict:
    return wait_for(lambda: (o := http.get(f"/v1/requests/{rid}").json())["status"] in until and o,
                    timeout_s, 0.05, f"request {rid} to reach {until}")


def test_async_request_lifecycle(http, client):
    resp = http.post("/v1/requests", json={"endpoint": "completions", "prompt": PROMPT, "max_tokens": 8,
                                           "temperature": 0})
    assert resp.status_code == 202 and resp.headers["location"].endswith(resp.json()["id"])
    obj = resp.json()
    assert obj["object"] == "request" and obj["status"] == "queued"
    done = poll(http, obj["id"])
    sync = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert done["status"] == "completed" and done["choices"][0]["text"] == sync.choices[0].text
    response = done["response"]
    assert response["object"] == "text_completion" and response["id"] == obj["id"]
    assert response["choices"][0]["text"] == sync.choices[0].text and response["usage"] == sync.usage.model_dump(
        exclude_none=True)
    with http.stream("GET", f"/v1/requests/{obj['id']}/events") as events:
        data = sse_data(events)
    assert data[-1] == "[DONE]" and len(data) == 2 and data[0]["status"] == "completed"  # finished: just the final
    chat = http.post("/v1/requests", json={"endpoint": "chat", "messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 4}).json()
    done = poll(http, chat["id"])
    assert done["response"]["object"] == "chat.completion"
    assert done["response"]["choices"][0]["message"]["content"] == done["choices"][0]["text"]


def test_async_events_then_cancel(http):
    obj = http.post("/v1/requests", json={"endpoint": "completions", "prompt": PROMPT, "max_tokens": 100_000,
                                          "ignore_eos": True}).json()
    rid = obj["id"]
    poll(http, rid, until=("running",))
    wait_for(lambda: http.get(f"/v1/requests/{rid}").json()["choices"][0]["text"], 30, 0.05, "some text")
    received: list = []
    with http.stream("GET", f"/v1/requests/{rid}/events") as events:
        lines = events.iter_lines()
        for line in lines:  # text so far, then deltas
            if line.startswith("data: "):
                received.append(line)
            if len(received) >= 5:
                break
        cancelled = http.delete(f"/v1/requests/{rid}").json()
        assert cancelled["status"] == "cancelled"
        for line in lines:
            if line.startswith("data: "):
                received.append(line)
    data = [orjson.loads(x[6:]) if x != "data: [DONE]" else "[DONE]" for x in received]
    assert data[-1] == "[DONE]"
    final = data[-2]
    assert final["object"] == "request" and final["status"] == "cancelled"
    streamed = "".join(d["choices"][0]["text"] for d in data[:-2])
    full = final["choices"][0]["text"]
    assert full.startswith(streamed) and len(streamed) > 0  # nothing duplicated or skipped before the cancel
    assert final["response"]["choices"][0]["finish_reason"] == "abort"
    assert http.get(f"/v1/requests/{rid}").json()["status"] == "cancelled"
    assert http.delete(f"/v1/requests/{rid}").json()["status"] == "cancelled"  # terminal: unchanged


def test_a_tenant_sees_only_its_own_requests(http, stack):
    rid = http.post("/v1/requests", json={"endpoint": "completions", "prompt": PROMPT, "max_tokens": 2}).json()["id"]
    other = httpx.Client(base_url=stack.api.url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30)
    unknown = f"cmpl-{uuid.uuid4().hex}"
    for method, suffix in (("GET", ""), ("GET", "/events"), ("DELETE", "")):
        theirs = other.request(method, f"/v1/requests/{rid}{suffix}")
        missing = other.request(method, f"/v1/requests/{unknown}{suffix}")
        assert theirs.status_code == missing.status_code == 404
        assert theirs.text.replace(rid, "ID") == missing.text.replace(unknown, "ID")  # same answer for both
    assert poll(http, rid)["status"] == "completed"  # B's DELETE did nothing
    assert stack.r.hget(c.request_key(rid), "tenant") == b"tenant-a"
    assert c.Result.decode(stack.r.get(c.result_key(rid))).tenant == "tenant-a"  # travelled in the queued request


def test_a_stored_response_is_its_tenants_alone_and_expires(http, stack):
    made = http.post("/v1/responses", json={"model": MODEL, "input": PROMPT, "max_output_tokens": 2}).json()
    other = httpx.Client(base_url=stack.api.url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30)
    for method in ("GET", "DELETE"):
        assert other.request(method, f"/v1/responses/{made['id']}").status_code == 404
    theirs = other.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": made["id"]})
    assert theirs.status_code == 404 and made["id"] in theirs.json()["error"]["message"]
    assert http.get(f"/v1/responses/{made['id']}").json()["output"] == made["output"]  # B's DELETE did nothing
    stack.r.pexpire(c.response_key(made["id"]), 1)  # as its TTL would
    time.sleep(0.05)
    gone = http.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": made["id"]})
    assert gone.status_code == 404 and "expired" in gone.json()["error"]["message"]
    assert 0 < stack.r.ttl(c.response_key(
        http.post("/v1/responses", json={"model": MODEL, "input": "y", "max_output_tokens": 2}).json()["id"]))


# -- disconnects -------------------------------------------------------------------------------

def wait_idle_worker(stack: Stack) -> c.Heartbeat:
    return wait_for(lambda: (hb := heartbeat(stack.r, WORKER)) and hb.running == 0 and hb.free_slots == NUM_SLOTS
                    and hb, 30, 0.1, "the worker's slots to be free")


def test_client_disconnect_mid_stream_frees_the_slot(http, stack):
    wait_idle_worker(stack)
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 100_000, "ignore_eos": True,
                                                      "stream": True}) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        rid = httpx.Response(200, content=first[6:]).json()["id"]
        wait_for(lambda: (hb := heartbeat(stack.r, WORKER)) and hb.running == 1, 30, 0.1, "the slot in use")
    # leaving the block closed the connection mid-stream
    result = c.Result.decode(wait_for(lambda: stack.r.get(c.result_key(rid)), 30, 0.05, "the cancelled result"))
    assert result.status == "cancelled" and result.completion_tokens < 100_000
    wait_idle_worker(stack)


def test_a_non_streaming_client_that_goes_away_cancels(stack):
    wait_idle_worker(stack)
    before = set(stack.r.scan_iter(match=c.result_key("*")))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.api.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY_A}"},
                   json={"prompt": PROMPT, "max_tokens": 100_000, "ignore_eos": True}, timeout=2.0)
    key = wait_for(lambda: set(stack.r.scan_iter(match=c.result_key("*"))) - before, 30, 0.1, "a new result")
    assert c.Result.decode(stack.r.get(key.pop())).status == "cancelled"
    wait_idle_worker(stack)


def test_one_pubsub_connection_serves_all_requests(http, stack):
    """Concurrent streams share the API process's single subscriber connection, on its one reply channel."""
    wait_idle_worker(stack)
    readers = []  # a dropped line iterator closes its connection: keep them
    with contextlib.ExitStack() as streams:
        for _ in range(4):
            resp = streams.enter_context(http.stream("POST", "/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 100_000, "ignore_eos": True, "stream": True}))
            readers.append(resp.iter_lines())
            while not next(readers[-1]).startswith("data: "):
                pass
        subscribers = {client["name"] or "worker": int(client["sub"]) for client in stack.r.client_list()
                       if int(client.get("sub", 0)) > 0}
    assert subscribers == {"worker": 1, "gaggle-api-pubsub": 1}  # the worker's abort channel; the reply channel
    wait_idle_worker(stack)  # and the four disconnects cancelled their requests


def test_a_killed_pubsub_connection_is_replaced_and_nothing_is_lost(client, stack):
    wait_idle_worker(stack)
    [victim] = [cl["id"] for cl in stack.r.client_list() if cl["name"] == "gaggle-api-pubsub"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # long enough to be running when a heartbeat (every 0.5 s) is read: 120 tokens could come and go between two
        pending = pool.submit(client.completions.create, model=MODEL, prompt=PROMPT, max_tokens=1500,
                              extra_body={"ignore_eos": True})
        wait_for(lambda: (hb := heartbeat(stack.r, WORKER)) and hb.running == 1, 30, 0.05, "the request running")
        stack.r.client_kill_filter(_id=victim)
        assert pending.result(timeout=60).usage.completion_tokens == 1500  # its final message may be lost: polled
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, stream=True))
    assert sum(len(ch.choices[0].text) > 0 for ch in chunks) >= 1
    [replacement] = [cl["id"] for cl in stack.r.client_list() if cl["name"] == "gaggle-api-pubsub"]
    assert replacement != victim


# -- service endpoints -------------------------------------------------------------------------

def test_models_health_ready_metrics(client, stack, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "rwkv-7"]  # the served name, then its default alias
    assert models.data[0].owned_by == "gaggle" and models.data[0].max_model_len > 0
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(stack.api.url + "/health").json()["status"] == "ok"
    ready = httpx.get(stack.api.url + "/ready")
    assert ready.status_code == 200 and ready.json()["workers"] == 1
    text = httpx.get(stack.api.url + "/metrics").text
    for line in ('gaggle_api_requests_total{code="200",endpoint="/v1/completions"}',
                 'gaggle_queue_depth{priority="interactive",tenant="*"}', "gaggle_workers_live 1.0",
                 "gaggle_api_time_to_first_token_seconds_count", "gaggle_api_prompt_tokens_total",
                 "gaggle_api_generation_tokens_total", "gaggle_workers_tokens_per_second",
                 "gaggle_workers_running_sequences", "gaggle_api_e2e_request_latency_seconds_bucket"):
        assert line in text, line
    assert "Traceback" not in stack.api.log(100_000), stack.api.log()
    assert "Traceback" not in log_of(stack.worker, 100_000)


def test_an_unwatched_async_request_publishes_no_deltas(http, stack):
    """Bulk async work costs no per-token pub/sub: deltas go out only while an /events stream watches."""
    rid = http.post("/v1/requests", json={"endpoint": "completions", "prompt": PROMPT, "max_tokens": 60,
                                          "ignore_eos": True}).json()["id"]
    pubsub = stack.r.pubsub()
    pubsub.subscribe(c.out_channel(rid))
    kinds = []
    done = poll(http, rid)
    while (msg := pubsub.get_message(timeout=0.5)) is not None:
        if msg["type"] == "message":
            kinds.append(orjson.loads(msg["data"])["type"])
    pubsub.close()
    assert done["status"] == "completed" and len(done["choices"][0]["text"]) > 0
    assert "final" in kinds and "delta" not in kinds, kinds

