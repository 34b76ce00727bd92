"""The API admits only what every live worker can run: workers report their engine's limits in their
heartbeats, so a request over them is a 400 at the door, not a failure after it was queued. A request that
reaches a worker anyway (queued before the API knew) fails as the client's error: a 400 too."""

from __future__ import annotations

import httpx
import orjson
import pytest

from api.generation import raise_for_status
from api.errors import OpenAIError
from api.limits import Limits
from api.settings import Settings
from tests.queue_helpers import submit, wait_results
from engine.params import MAX_STRUCTURED_BYTES
from tests.test_api_support import ApiServer, flushed, is_openai_error, wait_heartbeat
from worker import contract as c

WORKER = "limits-test-worker"
MAX_MODEL_LEN, SLOTS = 64, 4


@pytest.fixture(scope="module")
def stack(redis_server, tiny_model_path):
    from tests.queue_helpers import start_worker
    r = flushed(redis_server.url)
    worker = start_worker(redis_server.url, str(tiny_model_path), WORKER, "--max-model-len", str(MAX_MODEL_LEN),
                          "--max-num-seqs", str(SLOTS))
    api = ApiServer(redis_server.url)  # its own limits are the defaults: far above the worker's
    try:
        api.wait_healthy()
        wait_heartbeat(r, WORKER)
        with httpx.Client(base_url=api.url, timeout=60) as http:
            yield r, http
    finally:
        api.stop()
        worker.terminate()
        worker.wait(timeout=40)
        r.flushdb()


def completion(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "rwkv-7", "prompt": "Hello there", **body})


def last_entry_ids(r) -> dict[bytes, bytes]:
    """Each request stream's last generated entry id: a worker deletes finished entries, so XLEN alone cannot
    tell whether one was added and served meanwhile; an unchanged last id can."""
    streams = sorted(r.scan_iter(match=c.request_stream("*", "*")))
    return {s: r.xinfo_stream(s)["last-generated-id"] for s in streams}


def test_a_schema_over_the_size_limit_is_a_400_and_nothing_is_queued(stack):
    r, http = stack
    assert completion(http, max_tokens=2).status_code == 200  # the stream exists
    before = last_entry_ids(r)
    properties = {f"field_{i:05d}": {"type": "string", "description": "d" * 64} for i in range(4000)}
    schema = {"type": "object", "properties": properties}  # ~400 KiB: over the limit, under the body's 4 MiB
    assert MAX_STRUCTURED_BYTES < len(orjson.dumps(schema)) < (4 << 20)
    r_ = http.post("/v1/chat/completions", json={"model": "rwkv-7", "messages": [{"role": "user", "content": "Hi"}],
                                                  "response_format": {"type": "json_schema", "json_schema": {
                                                      "name": "big", "schema": schema}}})
    assert r_.status_code == 400 and is_openai_error(r_.json()), r_.text[:500]
    err = r_.json()["error"]
    assert err["param"] == "response_format.json_schema.schema", err
    assert str(MAX_STRUCTURED_BYTES) in err["message"], err
    assert last_entry_ids(r) == before


def test_min_tokens_over_the_fitted_max_tokens_is_a_400_and_nothing_is_queued(stack):
    """Without max_tokens a prompt gets what the context leaves it (here under 64 tokens): a min_tokens above
    that is refused at the door, not by the worker after a round trip."""
    r, http = stack
    chat = {"model": "rwkv-7", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    assert http.post("/v1/chat/completions", json={**chat, "min_tokens": 8}).status_code == 200
    before = last_entry_ids(r)
    over = http.post("/v1/chat/completions", json={**chat, "min_tokens": MAX_MODEL_LEN})
    assert over.status_code == 400 and is_openai_error(over.json()), over.text
    err = over.json()["error"]
    assert err["param"] == "min_tokens" and "max_tokens" in err["message"], err
    assert last_entry_ids(r) == before


def test_the_heartbeat_carries_the_workers_limits(stack):
    r, http = stack
    beat = c.Heartbeat.decode(r.get(c.heartbeat_key(WORKER)))
    assert (beat.max_model_len, beat.vocab_size, beat.num_slots) == (MAX_MODEL_LEN, 65536, SLOTS)
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
    # the longest prompt is said too, where a prompt past it is refused
    tokenized = http.post("/tokenize", json={"prompt": "Hi"}).json()
    assert tokenized["max_prompt_tokens"] == http.get("/v1/models").json()["data"][0]["max_prompt_tokens"] > 0


def test_over_the_workers_max_model_len_is_a_400(stack):
    _, http = stack
    ok = completion(http, max_tokens=8)
    assert ok.status_code == 200, ok.text
    over = completion(http, max_tokens=MAX_MODEL_LEN)
    assert over.status_code == 400 and is_openai_error(over.json()), over.text
    err = over.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert f"limit of {MAX_MODEL_LEN} tokens" in err["message"]


def test_more_choices_than_a_worker_has_slots_is_a_400(stack):
    _, http = stack
    assert completion(http, max_tokens=2, n=SLOTS).status_code == 200
    over = completion(http, max_tokens=2, n=SLOTS + 1)
    assert over.status_code == 400 and over.json()["error"]["param"] == "n", over.text
    assert f"between 1 and {SLOTS}" in over.json()["error"]["message"]
    for n in (0, 129, 2000):  # one limit quoted, whatever the value (the schema once said 128 above 128)
        body = {"model": "rwkv-7", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": n}
        for refused in (completion(http, max_tokens=2, n=n), http.post("/v1/chat/completions", json=body)):
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "n", refused.text
            assert refused.json()["error"]["message"] == f"n must be between 1 and {SLOTS}, got {n}"


def test_a_request_the_worker_refuses_fails_as_the_clients_error(stack):
    r, _ = stack
    submit(r, "over-the-limit", list(range(10, 20)), max_tokens=MAX_MODEL_LEN)  # queued past the API's checks
    result = wait_results(r, ["over-the-limit"], timeout_s=60)["over-the-limit"]
    assert result.status == c.STATUS_FAILED
    assert result.error["type"] == "invalid_request_error" and result.error["code"] == "invalid_request"
    assert "max_model_len" in result.error["message"]
    with pytest.raises(OpenAIError) as refused:
        raise_for_status(result)
    assert refused.value.status == 400
    with pytest.raises(OpenAIError) as crashed:  # a request that made the engine fail stays a server error
        raise_for_status(c.error_result("x", c.STATUS_FAILED, "boom", "dead_letter"))
    assert crashed.value.status == 500


def test_limits_take_the_tightest_live_worker():
    settings = Settings(max_model_len=4096, max_n=16)
    beat = lambda **kw: c.Heartbeat(**{**dict(name="w", pid=1, host="h", device="cpu", model="m", num_slots=8,  # noqa: E731
                                                 running=0, free_slots=8, tokens_per_s=0.0, started=0.0), **kw})
    workers = [beat(max_model_len=2048, vocab_size=65536), beat(max_model_len=0, num_slots=4),  # 0: not reported
               beat(max_model_len=100, num_slots=1, draining=True)]  # draining: takes nothing new
    assert Limits.of(settings, workers) == Limits(settings.max_prompt_tokens, 2048, 65536, 4, frozenset())
    assert Limits.of(settings) == Limits(settings.max_prompt_tokens, 4096, 65536, 16)


def test_heartbeats_of_older_and_newer_workers_decode():
    beat = c.Heartbeat(name="w", pid=1, host="h", device="cpu", model="m", num_slots=2, running=0, free_slots=2,
                       tokens_per_s=0.0, started=0.0, max_model_len=99)
    obj = orjson.loads(beat.encode())
    older = {k: v for k, v in obj.items() if k not in ("max_model_len", "vocab_size")}
    assert c.Heartbeat.decode(orjson.dumps(older)).max_model_len == 0
    assert c.Heartbeat.decode(orjson.dumps({**obj, "gpu_watts": 300})) == beat


def test_without_max_tokens_a_prompt_gets_what_the_length_leaves(stack):
    _, http = stack
    prompt = list(range(1000, 1050))  # 50 tokens: the default 16 would go past 64
    short = completion(http, prompt=prompt, ignore_eos=True).json()
    assert short["usage"] == {"prompt_tokens": 50, "completion_tokens": MAX_MODEL_LEN - 50,
                              "total_tokens": MAX_MODEL_LEN, "prompt_tokens_details": {"cached_tokens": 0}}, short
    assert short["choices"][0]["finish_reason"] == "length"
    chat = http.post("/v1/chat/completions", json={"model": "rwkv-7", "messages": [{"role": "user", "content": "Hi"}],
                                                   "ignore_eos": True}).json()  # chat's default: 1,024
    assert chat["usage"]["total_tokens"] == MAX_MODEL_LEN, chat
    explicit = completion(http, prompt=prompt, max_tokens=16)  # asked for: no silent shortening
    assert explicit.status_code == 400 and explicit.json()["error"]["param"] == "max_tokens"
    alone = completion(http, prompt=list(range(1000, 1000 + MAX_MODEL_LEN)))
    assert alone.status_code == 400 and alone.json()["error"]["code"] == "context_length_exceeded", alone.text
    assert alone.json()["error"]["param"] == "prompt"


def test_a_smaller_vocabulary_bounds_prompt_ids_logit_bias_and_stop_ids():
    import asyncio

    from api.jobs import chat_job, completion_job
    from api.schemas import ChatCompletionRequest, CompletionRequest
    from engine.tokenizer import WorldTokenizer

    settings, tokenizer = Settings(), WorldTokenizer.default()
    limits = Limits(settings.max_prompt_tokens, 4096, 1000, 4)  # a worker whose model has 1,000 tokens

    def refused(build, **body) -> str:
        schema = CompletionRequest if build is completion_job else ChatCompletionRequest
        with pytest.raises(OpenAIError) as e:
            asyncio.run(build(schema.model_validate(body), "t", settings, tokenizer, limits))
        assert e.value.status == 400
        return e.value.param

    assert refused(completion_job, prompt=[5, 1000]) == "prompt"
    assert refused(completion_job, prompt=[5], logit_bias={"1000": 1.0}) == "logit_bias"
    assert refused(chat_job, messages=[{"role": "user", "content": "Hi"}], stop_token_ids=[999, 1000]) \
        == "stop_token_ids"
    job = asyncio.run(completion_job(CompletionRequest.model_validate({"prompt": [5, 999], "logit_bias": {"999": 2}}),
                                     "t", settings, tokenizer, limits))
    assert job.requests[0].prompt_token_ids == [5, 999]


def test_results_of_newer_workers_decode():
    data = orjson.dumps({"v": c.SCHEMA_VERSION, "id": "r", "choices": [{"index": 0, "text": "a", "new_field": 1}]})
    assert c.Result.decode(data).choices[0].text == "a"
